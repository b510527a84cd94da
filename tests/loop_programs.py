"""Hand-built programs with ``loop`` equations (:mod:`partir_emu.core.loops`), for the runtime
tests (tests/unit/test_loops_runtime.py) and the MPI tier (tests/mpi/test_loops_mpi.py).

Global programs (one device) and SpmdPrograms whose loop bodies hold collectives: all_gather,
all_reduce, collective_permute, axis_index; reversed, nested, zero-length loops, a literal carry
and a literal const. Var ids come from one counter, so they are unique across a program and its
bodies as the IR requires.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from partir_emu.core.analysis import liveness
from partir_emu.core.ir import Atom, Eqn, Literal, Program, Var
from partir_emu.core.loops import LOOP, loop_eqn
from partir_emu.core.mesh import Mesh
from partir_emu.core.sharding import Sharding
from partir_emu.core.spmd import SpmdProgram

MM = (((1,), (0,)), ((), ()))           # [m, k] @ [k, n]
MV = (((1,), (0,)), ((), ()))           # [m, k] @ [k]


class Build:
    """Equations of one program (or body), Var ids from a shared counter."""

    def __init__(self, ids: itertools.count) -> None:
        self.ids, self.eqns = ids, []

    def var(self, shape: Sequence[int], dtype: str = "float32") -> Var:
        return Var(next(self.ids), tuple(shape), dtype)

    def eq(self, prim: str, ins: Sequence[Atom], out_shape: Sequence[int], dtype: str = "float32", **params) -> Var:
        out = self.var(out_shape, dtype)
        self.eqns.append(Eqn(prim, tuple(ins), (out,), params, source="loop_programs.py:1"))
        return out

    def loop(self, consts: Sequence[Atom], carry: Sequence[Atom], xs: Sequence[Atom], body: Program, length: int,
             reverse: bool = False) -> list[Var]:
        nk = len(carry)
        carry_out = [self.var(b.shape, b.dtype) for b in body.outputs[:nk]]
        ys = [self.var((length, *b.shape), b.dtype) for b in body.outputs[nk:]]
        self.eqns.append(loop_eqn(consts, carry, xs, carry_out, ys, body, length, reverse, source="loop_programs.py:2"))
        return [*carry_out, *ys]

    def program(self, inputs: Sequence[Var], outputs: Sequence[Atom], consts=()) -> Program:
        return Program(tuple(inputs), tuple(f"in{i}" for i in range(len(inputs))), tuple(self.eqns), tuple(outputs),
                       tuple(f"out{i}" for i in range(len(outputs))), tuple(consts))


# -- global (one-device) programs ------------------------------------------------------------------
def scan_program(reverse: bool = False) -> Program:
    """c = tanh(w @ c + x_i) over 5 rows; ys: sum(c) and the pre-activation; a const in the body."""
    ids = itertools.count()
    top = Build(ids)
    w, c0, xs = top.var((4, 4)), top.var((4,)), top.var((5, 4))
    b = Build(ids)
    wb, cb, xb = b.var((4, 4)), b.var((4,)), b.var((4,))
    bias = b.var((4,))
    t = b.eq("dot_general", [wb, cb], (4,), dimension_numbers=MV, preferred_element_type="float32")
    u = b.eq("add", [t, xb], (4,))
    u2 = b.eq("add", [u, bias], (4,))
    cn = b.eq("tanh", [u2], (4,))
    s = b.eq("reduce_sum", [cn], (), axes=(0,))
    body = b.program([wb, cb, xb], [cn, s, u], consts=[(bias, np.linspace(-0.5, 0.5, 4, dtype=np.float32))])
    c, ys, us = top.loop([w], [c0], [xs], body, 5, reverse)
    us2 = top.eq("mul", [us, Literal(2.0, "float32")], (5, 4))
    return top.program([w, c0, xs], [c, ys, us2])


def nested_program() -> Program:
    """An outer loop over 3 blocks, each an inner loop over 2 rows: c = 0.5 c + sin(r)."""
    ids = itertools.count()
    top = Build(ids)
    c0, xs = top.var((4,)), top.var((3, 2, 4))
    inner = Build(ids)
    ci, r = inner.var((4,)), inner.var((4,))
    h = inner.eq("mul", [ci, Literal(0.5, "float32")], (4,))
    cn = inner.eq("add", [h, inner.eq("sin", [r], (4,))], (4,))
    inner_p = inner.program([ci, r], [cn, cn])
    outer = Build(ids)
    co, blk = outer.var((4,)), outer.var((2, 4))
    c_in, ys_in = outer.loop([], [co], [blk], inner_p, 2, reverse=True)
    outer_p = outer.program([co, blk], [c_in, ys_in])
    c, ys = top.loop([], [c0], [xs], outer_p, 3)
    return top.program([c0, xs], [c, ys])


def literal_program() -> Program:
    """A literal carry (1.0), a literal const (2.0) and a literal y row."""
    ids = itertools.count()
    top = Build(ids)
    xs = top.var((4,))
    b = Build(ids)
    k, c, x = b.var(()), b.var(()), b.var(())
    cn = b.eq("mul", [c, b.eq("add", [x, k], ())], ())
    body = b.program([k, c, x], [cn, Literal(3.0, "float32")])
    c_out, ys = top.loop([Literal(2.0, "float32")], [Literal(1.0, "float32")], [xs], body, 4)
    return top.program([xs], [c_out, ys])


def zero_length_program() -> Program:
    """A loop of length 0: the carry passes through, the ys are zeros of shape (0, 3)."""
    ids = itertools.count()
    top = Build(ids)
    c0, xs = top.var((3,)), top.var((0, 3))
    b = Build(ids)
    c, x = b.var((3,)), b.var((3,))
    cn = b.eq("add", [c, x], (3,))
    body = b.program([c, x], [cn, cn])
    c_out, ys = top.loop([], [c0], [xs], body, 0)
    return top.program([c0, xs], [c_out, ys])


GLOBAL_PROGRAMS = {"scan": scan_program, "scan_reverse": lambda: scan_program(True), "nested": nested_program,
                   "literal": literal_program, "zero_length": zero_length_program}


# -- SPMD programs ------------------------------------------------------------------------------
MESH = Mesh(x=2, y=2)
REP = Sharding.replicated


def _dims(*dims) -> Sharding:
    return Sharding(tuple(tuple(d) for d in dims))


def _layer_body(ids: itertools.count, scale_shape=(6,)) -> Program:
    """One layer on h[4 local rows (x), 6]: column-parallel matmul (w tiled by y), all_gather over y,
    tanh, scale; a halo-like collective_permute over x; the global sum, all_reduced over x."""
    b = Build(ids)
    scale, h, w = b.var(scale_shape), b.var((4, 6)), b.var((6, 3))
    part = b.eq("dot_general", [h, w], (4, 3), dimension_numbers=MM, preferred_element_type="float32")
    g = b.eq("all_gather", [part], (4, 6), axes=("y",), dim=1)
    t = b.eq("tanh", [g], (4, 6))
    h2 = b.eq("mul", [t, b.eq("broadcast_in_dim", [scale], (4, 6), shape=(4, 6), broadcast_dimensions=(1,))], (4, 6))
    nb = b.eq("collective_permute", [h2], (4, 6), axes=("x",), shift=1, wrap=True)
    hn = b.eq("add", [h2, b.eq("mul", [nb, Literal(0.5, "float32")], (4, 6))], (4, 6))
    s = b.eq("all_reduce", [b.eq("reduce_sum", [hn], (), axes=(0, 1))], (), axes=("x",), op="sum")
    return b.program([scale, h, w], [hn, s])


def layers_spmd(reverse: bool = False, length: int = 3) -> SpmdProgram:
    """Scan over ``length`` stacked layer weights W[L, 6, 6] (dim 2 tiled by y), h[8, 6] (dim 0 by x)."""
    ids = itertools.count()
    top = Build(ids)
    h0, ws, scale = top.var((4, 6)), top.var((length, 6, 3)), top.var((6,))
    h, sums = top.loop([scale], [h0], [ws], _layer_body(ids), length, reverse)
    out = top.eq("mul", [sums, Literal(0.25, "float32")], (length,))
    prog = top.program([h0, ws, scale], [h, out])
    return SpmdProgram(MESH, prog, (_dims(("x",), ()), _dims((), (), ("y",)), REP(1)),
                       (_dims(("x",), ()), REP(1)), ((8, 6), (length, 6, 6), (6,)), ((8, 6), (length,)))


def nested_spmd() -> SpmdProgram:
    """An outer loop over 2 stages (all_reduce over y and axis_index in its body), each an inner
    scan over 3 layers (the layer body above) of the stage's stacked weights W[2, 3, 6, 6]."""
    ids = itertools.count()
    top = Build(ids)
    h0, ws, scale = top.var((4, 6)), top.var((2, 3, 6, 3)), top.var((6,))
    ob = Build(ids)
    sc, ho, wst = ob.var((6,)), ob.var((4, 6)), ob.var((3, 6, 3))
    hi, sums = ob.loop([sc], [ho], [wst], _layer_body(ids), 3)
    idx = ob.eq("convert_element_type", [ob.eq("axis_index", [], (), "int32", axes=("y",))], (), new_dtype="float32")
    idx3 = ob.eq("broadcast_in_dim", [idx], (3,), shape=(3,), broadcast_dimensions=())
    tot = ob.eq("all_reduce", [ob.eq("mul", [sums, idx3], (3,))], (3,), axes=("y",), op="sum")
    outer = ob.program([sc, ho, wst], [hi, tot])
    h, tots = top.loop([scale], [h0], [ws], outer, 2)
    prog = top.program([h0, ws, scale], [h, tots])
    return SpmdProgram(MESH, prog, (_dims(("x",), ()), _dims((), (), (), ("y",)), REP(1)),
                       (_dims(("x",), ()), REP(2)), ((8, 6), (2, 3, 6, 6), (6,)), ((8, 6), (2, 3)))


def tiny_spmd() -> SpmdProgram:
    """For the hand-computed peak: c[4] carried over xs[3, 4], body s = c + x_i, t = all_reduce(s)."""
    ids = itertools.count()
    top = Build(ids)
    c0, xs = top.var((4,)), top.var((3, 4))
    b = Build(ids)
    c, x = b.var((4,)), b.var((4,))
    s = b.eq("add", [c, x], (4,))
    t = b.eq("all_reduce", [s], (4,), axes=("a",), op="sum")
    body = b.program([c, x], [t, s])
    c_out, ys = top.loop([], [c0], [xs], body, 3)
    prog = top.program([c0, xs], [c_out, ys])
    return SpmdProgram(Mesh(a=2), prog, (REP(1), REP(2)), (REP(1), REP(2)),
                       ((4,), (3, 4)), ((4,), (3, 4)))


def literal_spmd() -> SpmdProgram:
    """A literal carry (1.0) and a literal const (2.0) on Mesh(a=2); the first iteration's
    all_reduce reads the literal carry itself; a literal y row."""
    ids = itertools.count()
    top = Build(ids)
    xs = top.var((4,))
    b = Build(ids)
    k, c, x = b.var(()), b.var(()), b.var(())
    r = b.eq("all_reduce", [c], (), axes=("a",), op="sum")
    cn = b.eq("mul", [r, b.eq("add", [x, k], ())], ())
    body = b.program([k, c, x], [cn, Literal(3.0, "float32")])
    c_out, ys = top.loop([Literal(2.0, "float32")], [Literal(1.0, "float32")], [xs], body, 4)
    prog = top.program([xs], [c_out, ys])
    return SpmdProgram(Mesh(a=2), prog, (REP(1),), (REP(0), REP(1)), ((4,),), ((), (4,)))


def zero_length_spmd() -> SpmdProgram:
    """The layer scan with 0 layers: nothing runs, no collective is executed."""
    return layers_spmd(length=0)


SPMD_PROGRAMS = {"layers": layers_spmd, "layers_reverse": lambda: layers_spmd(True), "nested": nested_spmd,
                 "tiny": tiny_spmd, "literal": literal_spmd, "zero_length": zero_length_spmd}


def global_inputs(shapes: Sequence[Sequence[int]], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(tuple(s)).astype(np.float32) for s in shapes]


def rule5_peak(program: Program) -> int:
    """Peak bytes of ``program`` by rules 1-5 of :mod:`partir_emu.core.analysis`, from shapes alone
    (an independent statement of the convention the engine measures on real arrays)."""
    lv = liveness(program)
    live = sum(v.nbytes for v in lv.initial)
    peak = live
    live -= sum(v.nbytes for v in lv.at_start)
    for i, e in enumerate(program.eqns):
        live += sum(o.nbytes for o in e.outputs)
        body = rule5_peak(e.params["body"]) if e.prim == LOOP and int(e.params["length"]) > 0 else 0
        peak = max(peak, live + body)
        live -= sum(v.nbytes for v in lv.after[i])
    return peak

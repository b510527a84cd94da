"""A grouping shared by programs of one structure (:class:`partir_emu.hwmodels.compute.fusion_plan.Groupings`)
measures each program's own slices: a slice reads the bytes it keeps of its operand, and those differ
between programs of one structure (the lowered transformers' only slice, the embedding gather, keeps
more than its table, so it reads the whole table in every program and cannot tell). Cost: < 0.1 s."""
from __future__ import annotations

import numpy as np

from partir_emu.core.ir import Eqn, Program, Var
from partir_emu.hwmodels.compute.fusion import fuse
from partir_emu.hwmodels.compute.fusion_plan import Groupings
from partir_emu.hwmodels.machine.specs import load_spec


def _program(rows: int, kept: int) -> Program:
    """x[rows, 8] -> slice of ``kept`` rows -> exp -> sum: one fused kernel reading the slice."""
    x, y, z, w = Var(0, (rows, 8), "float32"), Var(1, (kept, 8), "float32"), Var(2, (kept, 8), "float32"), \
        Var(3, (kept,), "float32")
    eqns = (Eqn("slice", (x,), (y,), {"start_indices": (0, 0), "limit_indices": (kept, 8), "strides": None}),
            Eqn("exp", (y,), (z,), {}), Eqn("reduce_sum", (z,), (w,), {"axes": (1,)}))
    return Program((x,), ("x",), eqns, (w,), ("w",))


def test_each_program_reads_its_own_slice():
    compiler = load_spec("h100").kernels
    shared = Groupings()
    for rows, kept in ((16, 4), (32, 2)):
        prog = _program(rows, kept)
        zero = np.zeros(len(prog.eqns))
        assert (shared.find(prog, compiler.variant) is not None) == (rows == 32)   # the second takes the first's
        own = fuse(prog, zero, zero, compiler)
        plan = fuse(prog, zero, zero, compiler, shared)
        assert np.array_equal(plan.bytes, own.bytes) and np.array_equal(plan.group_of, own.group_of)
        assert plan.bytes[0] == kept * 8 * 4 + kept * 4            # the slice read, the sum written

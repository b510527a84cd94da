"""The shared program analyses (core/analysis.py) on hand-written programs."""
from __future__ import annotations

import numpy as np

from partir_emu.core.analysis import dead_code_elimination, dependencies, liveness
from partir_emu.core.ir import Eqn, Literal, Program, Var


def _prog() -> Program:
    # x, y inputs (y unused), c const; a = x*x; b = neg a; d = a + c (dead); out = b * 2
    x, y, c = Var(0, (4,), "float32"), Var(1, (4,), "float32"), Var(2, (4,), "float32")
    a, b, d, o = (Var(i, (4,), "float32") for i in (3, 4, 5, 6))
    eqns = (Eqn("mul", (x, x), (a,)), Eqn("neg", (a,), (b,)), Eqn("add", (a, c), (d,)),
            Eqn("mul", (b, Literal(2.0, "float32")), (o,)))
    return Program((x, y), ("x", "y"), eqns, (o, x), ("out", "x_again"), ((c, np.ones(4, np.float32)),))


def test_liveness_releases_each_value_once_after_its_last_use():
    lv = liveness(_prog())
    assert [v.id for v in lv.initial] == [0, 1, 2]
    assert [v.id for v in lv.at_start] == [1]                  # y: read by nobody, not an output
    assert [sorted(v.id for v in g) for g in lv.after] == [[], [], [2, 3, 5], [4]]
    assert lv.last_use[0] == 4 and lv.last_use[6] == 4           # program outputs: never released


def test_dependencies_are_producers_in_operand_order():
    assert dependencies(_prog()) == ((), (0,), (0,), (1,))


def test_dead_code_elimination_keeps_what_the_outputs_need():
    p = _prog()
    eqns, consts = dead_code_elimination(p.eqns, p.consts, p.outputs)
    assert [e.prim for e in eqns] == ["mul", "neg", "mul"] and consts == []

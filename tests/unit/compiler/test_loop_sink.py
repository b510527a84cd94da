"""All-reduce code motion out of loops (``compiler/lowering/sink.py``) on hand-built loop bodies: the
rewrite fires on exactly its pattern (``acc + all_reduce(g)`` into a carry read by nothing else) and
on nothing looser. The real microbatched step: ``tests/integration/test_microbatches.py``."""
from __future__ import annotations

import pytest

from partir_emu.compiler.lowering.sink import Sunk, sink_all_reduces
from partir_emu.core.ir import Eqn, Program, Var

F32 = "float32"


def _body(*, reads_acc: bool = False, reads_sum: bool = False, collective: str = "all_reduce",
          op: str = "sum", acc_is_output_too: bool = False) -> Program:
    """One const ``w``, one carry ``acc``: ``g = w * w; c = collective(g); out = acc + c``."""
    w, acc, g, c, out, extra = (Var(i, (4,), F32) for i in range(6))
    params = {"axes": ("batch",), "op": op} if collective == "all_reduce" else {"axes": ("batch",), "dim": 0}
    eqns = [Eqn("mul", (w, w), (g,)), Eqn(collective, (g,), (c,), params), Eqn("add", (acc, c), (out,))]
    outputs: list[Var] = [out]
    names = ["acc"]
    if reads_acc:
        eqns.append(Eqn("mul", (acc, w), (extra,)))
        outputs.append(extra)
        names.append("y")
    if reads_sum:
        eqns.append(Eqn("mul", (c, w), (extra,)))
        outputs.append(extra)
        names.append("y")
    if acc_is_output_too:
        outputs.append(acc)
        names.append("y")
    return Program((w, acc), ("w", "acc"), tuple(eqns), tuple(outputs), tuple(names))


def test_the_pattern_moves_the_all_reduce_out():
    body, sunk = sink_all_reduces(_body(), 1, 1, frozenset({0}))
    assert sunk == (Sunk(0, ("batch",)),)
    assert [e.prim for e in body.eqns] == ["mul", "add"]
    add = body.eqns[-1]
    assert add.inputs == (body.inputs[1], body.eqns[0].outputs[0])      # acc + the device's own g
    assert body.outputs == (add.outputs[0],)


@pytest.mark.parametrize("kw", [
    dict(reads_acc=True),                  # the body reads the whole accumulator: it must stay whole
    dict(reads_sum=True),                  # the reduced gradient has another reader in the body
    dict(collective="reduce_scatter"),     # a sharded accumulator (ZeRO): carrying it pending would unshard it
    dict(op="max"),                        # a max of sums is not the sum of maxes
    dict(acc_is_output_too=True),          # the carry-in leaves the body as a value of its own
])
def test_anything_looser_is_left_alone(kw):
    prog = _body(**kw)
    body, sunk = sink_all_reduces(prog, 1, 1, frozenset({0}))
    assert sunk == () and body is prog


def test_a_carry_that_is_not_eligible_is_left_alone():
    """The caller excludes a carry whose initial value is a literal (no buffer to make partial)."""
    prog = _body()
    assert sink_all_reduces(prog, 1, 1, frozenset()) == (prog, ())

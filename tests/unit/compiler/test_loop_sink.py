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


def _scatter_body() -> Program:
    """Const ``w`` [4], carry ``acc`` [2, 4] (a stacked per-virtual-stage gradient), x row ``idx``:
    ``g = w * w; c = all_reduce(g); out = scatter-add(acc, idx, c)`` (a circular pipeline's tick)."""
    w, g, c = (Var(i, (4,), F32) for i in range(3))
    acc, out = Var(3, (2, 4), F32), Var(4, (2, 4), F32)
    idx = Var(5, (1,), "int32")
    eqns = (Eqn("mul", (w, w), (g,)), Eqn("all_reduce", (g,), (c,), {"axes": ("batch",), "op": "sum"}),
            Eqn("scatter-add", (acc, idx, c), (out,), {}))
    return Program((w, acc, idx), ("w", "acc", "idx"), eqns, (out,), ("acc",))


@pytest.mark.parametrize("uniform, moved", [
    (lambda a, axes: True, True),     # every device of the batch group adds at the same row
    (lambda a, axes: False, False),   # not proven (the default): devices might add at other rows
])
def test_a_scatter_add_into_the_carry_moves_only_with_a_uniform_index(uniform, moved):
    prog = _scatter_body()
    body, sunk = sink_all_reduces(prog, 1, 1, frozenset({0}), uniform)
    if not moved:
        assert sunk == () and body is prog
        return
    assert sunk == (Sunk(0, ("batch",)),)
    assert [e.prim for e in body.eqns] == ["mul", "scatter-add"]
    assert body.eqns[-1].inputs == (prog.inputs[1], prog.inputs[2], body.eqns[0].outputs[0])


def test_an_index_is_uniform_only_from_layouts_and_device_independent_equations():
    """``loops._uniform_in``: a body input tiled (or pending) over the group's axes differs between its
    devices; one tiled over another axis, and what device-independent equations compute from it, do not;
    ``axis_index`` does."""
    from partir_emu.compiler.lowering.loops import _uniform_in
    from partir_emu.core.sharding import Sharding
    on_batch, on_stage, pending = (Var(i, (4,), "int32") for i in range(3))
    doubled, where, mixed = Var(3, (4,), "int32"), Var(4, (), "int32"), Var(5, (4,), "int32")
    body = Program((on_batch, on_stage, pending), ("a", "b", "c"),
                   (Eqn("add", (on_stage, on_stage), (doubled,)),
                    Eqn("axis_index", (), (where,), {"axes": ("stage",)}),
                    Eqn("add", (doubled, where), (mixed,))),
                   (doubled, mixed), ("d", "m"))
    rows = [Sharding((("batch",),)), Sharding((("stage",),)), Sharding(((),), ("batch",))]
    uniform = _uniform_in(body, rows)
    assert not uniform(on_batch, ("batch",)) and uniform(on_batch, ("model",))
    assert uniform(on_stage, ("batch",)) and uniform(doubled, ("batch",)) and not uniform(doubled, ("stage",))
    assert not uniform(pending, ("batch",))
    assert not uniform(mixed, ("batch",))

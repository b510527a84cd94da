"""The buffers a stack shares (``hwmodels.compute.memory.stack_liveness``), on hand-built programs
whose peak is known by hand: a ``reshape`` is a view of its operand (one buffer, alive until the last
reader of either), an ``add`` that accumulates into a loop carry writes into the carry's buffer; the
runtime's ``"program"`` convention keeps every value its own buffer (what LocalMesh measures). The
stack policy here is ``"residuals"`` (every value saved, no recompute): the sharing rules alone."""
from __future__ import annotations

from partir_emu.core.ir import Eqn, Program, Var
from partir_emu.core.loops import loop_eqn
from partir_emu.hwmodels.compute.memory import peak_memory, stack_liveness

F32 = "float32"
N = 1024                     # elements: 4 KiB a buffer
B = 4 * N
STACK = "residuals"
DOT = {"dimension_numbers": (((1,), (0,)), ((), ())), "precision": None, "preferred_element_type": None}


def _v(i: int, shape=(32, 32)) -> Var:
    return Var(i, shape, F32)


def _view_program() -> Program:
    """``a = w @ w; r = reshape(a); b = w @ w; c = r * b; d = a * c``: ``a`` and its view ``r`` are
    alive together from the reshape until ``d``."""
    w, a, r, b, c, d = _v(0), _v(1), _v(2, (1024,)), _v(3), _v(4), _v(5)
    rb = _v(6, (1024,))
    eqns = (Eqn("dot_general", (w, w), (a,), DOT), Eqn("reshape", (a,), (r,), {"new_sizes": (1024,), "dimensions": None}),
            Eqn("dot_general", (w, w), (b,), DOT), Eqn("reshape", (b,), (rb,), {"new_sizes": (1024,), "dimensions": None}),
            Eqn("mul", (r, rb), (c,)), Eqn("mul", (a, c), (d,)))
    return Program((w,), ("w",), eqns, (d,), ("d",))


def test_a_reshape_is_a_view_under_a_stack_and_a_buffer_under_the_runtime():
    prog = _view_program()
    own = peak_memory(prog)                                  # w, a, r, b at the second dot; a, r, rb, c at the mul
    assert own.peak_bytes == 4 * B
    shared = peak_memory(prog, policy=STACK)
    assert shared.peak_bytes == 3 * B                        # r is a's bytes, rb is b's (b lives to the mul)
    lv, views = stack_liveness(prog, STACK)
    assert views == {2, 6}
    assert lv.last_use[1] == 5                               # a lives to the last reader of a or its view
    assert lv.last_use[3] == 4                               # b to rb's last reader


def _accumulating_loop() -> Program:
    """A loop of 3 whose body adds ``w @ w`` into the carry ``acc``."""
    w, acc, g, out = _v(10), _v(11), _v(12), _v(13)
    body = Program((w, acc), ("w", "acc"), (Eqn("dot_general", (w, w), (g,), DOT), Eqn("add", (acc, g), (out,))),
                   (out,), ("acc",))
    W, A0, A = _v(0), _v(1), _v(2)
    loop = loop_eqn([W], [A0], [], [A], [], body, 3)
    return Program((W, A0), ("params/w", "acc0"), (loop,), (A,), ("acc",))


def test_an_accumulating_add_writes_into_its_carry():
    prog = _accumulating_loop()
    body = prog.eqns[0].params["body"]
    # at the add: acc, g and the sum; under a stack the sum is acc's buffer
    assert peak_memory(body).live_bytes[2] == 3 * B
    assert peak_memory(body, policy=STACK).live_bytes[2] == 2 * B
    lv, inplace = stack_liveness(body, STACK)
    assert inplace == {13} and lv.last_use[11] == len(body.eqns)
    # the loop point: W, A0 and A, plus the body's peak (w, acc, g at the dot); a stack holds the
    # body's w and acc in the loop's operands and the donated A0 in A
    assert peak_memory(prog).peak_bytes == 6 * B
    assert peak_memory(prog, policy=STACK).peak_bytes == 3 * B


def test_an_add_of_two_computed_values_is_not_in_place():
    """Only a value that enters the program and dies at the add is written into; ``g + g`` makes a buffer."""
    w, g, out = _v(0), _v(1), _v(2)
    prog = Program((w,), ("w",), (Eqn("dot_general", (w, w), (g,), DOT), Eqn("add", (g, g), (out,))), (out,), ("o",))
    assert stack_liveness(prog, STACK)[1] == frozenset()
    assert peak_memory(prog, policy=STACK).live_bytes[2] == 2 * B


def test_a_transpose_of_unit_dims_is_a_view_and_one_of_data_is_not():
    """Moving a size-1 dim (a pipeline's stage dim, one a device) keeps the data order: XLA's bitcast,
    so a view; a transpose that reorders the data is a copy, its own buffer."""
    w, a = _v(0), _v(1)
    for shape, perm, view in (((1, 32, 32), (1, 0, 2), True), ((32, 1, 32), (2, 1, 0), False)):
        t, o = Var(2, tuple(shape[p] for p in perm), F32), _v(3, tuple(shape[p] for p in perm))
        x = Var(4, shape, F32)
        eqns = (Eqn("dot_general", (w, w), (a,), DOT), Eqn("reshape", (a,), (x,), {"new_sizes": shape, "dimensions": None}),
                Eqn("transpose", (x,), (t,), {"permutation": perm}), Eqn("mul", (t, t), (o,)))
        prog = Program((w,), ("w",), eqns, (o,), ("o",))
        _, views = stack_liveness(prog, STACK)
        assert (2 in views) == view, (shape, perm, views)


def test_a_dynamic_update_slice_at_its_operands_last_use_writes_in_place():
    """``s2 = dynamic_update_slice(s, u, i)`` where nothing reads ``s`` after: one buffer (XLA's
    in-place update: a pipeline's stash written a slot a tick); while ``s`` is still read, a copy."""
    s, u, i = _v(0), Var(1, (1, 32), F32), Var(2, (), "int32")
    z = Var(3, (), "int32")
    s2, r = _v(4), _v(5)
    for later_read, shared in ((False, True), (True, False)):
        tail = (Eqn("mul", (s2, s), (r,)),) if later_read else (Eqn("mul", (s2, s2), (r,)),)
        eqns = (Eqn("dynamic_update_slice", (s, u, i, z), (s2,)), *tail)
        prog = Program((s, u, i, z), ("s", "u", "i", "z"), eqns, (r,), ("r",))
        _, views = stack_liveness(prog, STACK)
        assert (4 in views) == shared, (later_read, views)

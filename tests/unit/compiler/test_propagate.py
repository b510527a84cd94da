"""Propagation: seed shardings (ManualPartition on hand-built programs) → the expected sharding of
named values, the factor tiling of equations, and the expected conflicts with their origins."""
from __future__ import annotations

import pytest

from partir_emu.compiler.api import partition
from partir_emu.compiler.state import ProgramIndex, ShardingState
from partir_emu.compiler.tactics import REPLICATED, AutomaticPartition
from partir_emu.compiler.tactics import ManualPartition as MP
from partir_emu.core.mesh import Mesh
from partir_emu.core.sharding import Sharding
from partir_emu.errors import MeshError, ShardingError, TacticError
from tests.unit.compiler.helpers import ProgramBuilder, lit, state_after

A2 = Mesh(a=2)
AB = Mesh(a=2, b=2)


def s(text: str, st: ShardingState, v) -> bool:
    return str(st.sharding(v)) == text


def mlp():
    """x[8,4] @ w1[4,16] → tanh → @ w2[16,4] → reduce_sum over dim 1."""
    b = ProgramBuilder()
    x, w1, w2 = b.input("x", 8, 4), b.input("w1", 4, 16), b.input("w2", 16, 4)
    h = b.matmul(x, w1)
    t = b.unary("tanh", h)
    y = b.matmul(t, w2)
    loss = b.reduce("reduce_sum", y, (1,))
    return b.build(loss), dict(x=x, w1=w1, w2=w2, h=h, t=t, y=y, loss=loss)


# -- forward and backward ---------------------------------------------------------------------
def test_batch_seed_flows_forward_through_every_op():
    prog, v = mlp()
    st = state_after(prog, A2, MP({"x": 0}, axis="a"))
    for name in ("h", "t", "y", "loss"):
        assert str(st.sharding(v[name])).startswith("{0:(a,)}"), name
    assert s("{}", st, v["w1"]) and s("{}", st, v["w2"]) and st.conflicts == []


def test_batch_seed_tiles_the_matmul_row_factor_only():
    prog, v = mlp()
    st = state_after(prog, A2, MP({"x": 0}, axis="a"))
    rule = st.rules[0]
    (i,), (k,) = rule.operands[0]
    assert st.eqn_factors[0] == {i: ("a",)} and k in rule.reduction


def test_model_seed_on_w1_columns_reaches_w2_rows_backwards():
    prog, v = mlp()
    st = state_after(prog, A2, MP({"w1": 1}, axis="a"))
    assert s("{1:(a,)}", st, v["h"]) and s("{1:(a,)}", st, v["t"])
    assert s("{0:(a,)}", st, v["w2"])          # an input tiled by propagation, not by the tactic
    assert s("{}", st, v["y"]) and s("{}", st, v["x"])


def test_contracting_tiling_makes_the_result_partial():
    prog, v = mlp()
    st = state_after(prog, A2, MP({"w1": 1}, axis="a"))
    assert st.result_sharding(2) == Sharding(((), ()), ("a",))
    assert st.sharding(v["y"]) == Sharding(((), ()))     # value_dims never hold partials


def test_seed_on_w2_flows_backwards_to_w1():
    prog, v = mlp()
    st = state_after(prog, A2, MP({"w2": 0}, axis="a"))
    assert s("{1:(a,)}", st, v["t"]) and s("{1:(a,)}", st, v["h"]) and s("{1:(a,)}", st, v["w1"])


def test_origins_name_the_tactic_the_input_and_the_op():
    prog, v = mlp()
    st = state_after(prog, A2, MP({"w1": 1}, axis="a"))
    assert st.origin[(v["w1"].id, "a")] == "tactic 0 (a) (input 'w1' dim 1)"
    assert st.origin[(v["h"].id, "a")] == f"tactic 0 (a) via dot_general from {v['w1']}"
    assert st.origin[(v["t"].id, "a")] == f"tactic 0 (a) via tanh from {v['h']}"
    assert st.origin[(v["w2"].id, "a")] == f"tactic 0 (a) via dot_general from {v['t']}"


def test_tactic_name_is_the_label():
    prog, v = mlp()
    st = state_after(prog, A2, MP({"x": 0}, axis="a", name="bp"))
    assert st.tactics_applied == ["bp"] and st.origin[(v["x"].id, "a")] == "bp (input 'x' dim 0)"


def test_two_axes_compose_on_one_value():
    prog, v = mlp()
    st = state_after(prog, AB, MP({"x": 0}, axis="a"), MP({"w1": 1}, axis="b"))
    assert s("{0:(a,), 1:(b,)}", st, v["h"]) and s("{0:(b,)}", st, v["w2"])
    assert st.result_sharding(2) == Sharding((("a",), ()), ("b",))


def test_two_axes_on_one_dim_stack_major_to_minor():
    prog, v = mlp()
    st = state_after(prog, AB, MP({"x": 0}, axis="a"), MP({"x": 0}, axis="b"))
    assert s("{0:(a,b)}", st, v["h"]) and s("{0:(a,b)}", st, v["loss"])


def test_negative_dim_counts_from_the_end():
    prog, v = mlp()
    st = state_after(prog, A2, MP({"w1": -1}, axis="a"))
    assert s("{1:(a,)}", st, v["w1"])


def test_first_matching_pattern_decides():
    prog, v = mlp()
    st = state_after(prog, A2, MP({"w1": 1, "w*": 0}, axis="a"))
    assert s("{1:(a,)}", st, v["w1"]) and s("{0:(a,)}", st, v["w2"])


def test_initial_state_is_replicated_everywhere():
    prog, v = mlp()
    st = ShardingState.initial(prog, A2)
    assert all(st.sharding(x).is_replicated() for x in v.values())
    assert st.eqn_factors == [{}, {}, {}, {}] and st.conflicts == []


def test_partition_keeps_a_state_per_tactic():
    prog, v = mlp()
    states = partition(prog, AB, [MP({"x": 0}, axis="a"), MP({"w1": 1}, axis="b")])
    assert len(states) == 3
    assert [str(st.sharding(v["h"])) for st in states] == ["{}", "{0:(a,)}", "{0:(a,), 1:(b,)}"]


def test_copy_shares_the_index_but_not_the_decisions():
    prog, v = mlp()
    st = ShardingState.initial(prog, A2)
    cp = st.copy()
    cp.value_dims[v["x"]] = (("a",), ())
    assert cp.index is st.index and s("{}", st, v["x"])


# -- the program index ------------------------------------------------------------------------
def test_index_shares_one_rule_between_identical_equations():
    b = ProgramBuilder()
    x, w = b.input("x", 8, 4), b.input("w", 4, 4)
    y = b.matmul(b.matmul(x, w), w)
    ix = ProgramIndex.build(b.build(y))
    assert ix.rules[0] is ix.rules[1] and ix.factor_dims[0] is ix.factor_dims[1]


def test_index_slots_and_factor_dims():
    b = ProgramBuilder()
    x, w = b.input("x", 8, 4), b.input("w", 4, 6)
    y = b.matmul(x, w)
    ix = ProgramIndex.build(b.build(y))
    assert [v for v, _ in ix.slots[0]] == [x, w, y]
    (i,), (k,) = ix.rules[0].operands[0]
    assert ix.factor_dims[0][k] == ((0, 1), (1, 0)) and ix.factor_dims[0][i] == ((0, 0), (2, 0))
    assert ix.result_slot[y] == 2 and ix.producers[y] == 0 and ix.users[x] == [0]


def test_index_skips_scalar_operands():
    b = ProgramBuilder()
    x = b.input("x", 8, 4)
    y = b.binary("mul", x, lit(2.0))
    ix = ProgramIndex.build(b.build(y))
    assert [v for v, _ in ix.slots[0]] == [x, y] and ix.result_slot[y] == 1


# -- per-op behaviour -------------------------------------------------------------------------
def test_transpose_moves_the_axis_to_the_permuted_dim():
    b = ProgramBuilder()
    x = b.input("x", 8, 4)
    t = b.transpose(x, (1, 0))
    st = state_after(b.build(t), A2, MP({"x": 0}, axis="a"))
    assert s("{1:(a,)}", st, t)


def test_reduce_sum_over_the_tiled_dim_is_partial_not_tiled():
    b = ProgramBuilder()
    x = b.input("x", 8, 4)
    r = b.reduce("reduce_sum", x, (0,))
    st = state_after(b.build(r), A2, MP({"x": 0}, axis="a"))
    assert s("{}", st, r) and st.result_sharding(0).partial == ("a",) and st.conflicts == []


@pytest.mark.parametrize("prim,op", [("reduce_max", "max"), ("reduce_min", "min")])
def test_max_over_a_tiled_dim_is_a_pending_max(prim, op):
    b = ProgramBuilder()
    x = b.input("x", 8, 4)
    r = b.reduce(prim, x, (0,))
    st = state_after(b.build(r), A2, MP({"x": 0}, axis="a"))
    res = st.result_sharding(0)
    assert s("{}", st, r) and res.partial == ("a",) and res.partial_op == op and st.conflicts == []


@pytest.mark.parametrize("prim", ["argmax", "reduce_prod"])
def test_blocked_reduction_leaves_the_result_untiled_without_conflict(prim):
    b = ProgramBuilder()
    x = b.input("x", 8, 4)
    r = b.reduce(prim, x, (0,))
    st = state_after(b.build(r), A2, MP({"x": 0}, axis="a"))
    assert s("{}", st, r) and st.result_sharding(0).partial == () and st.conflicts == []
    assert st.eqn_factors[0] == {}


def test_reduce_max_over_another_dim_propagates():
    b = ProgramBuilder()
    x = b.input("x", 8, 4)
    r = b.reduce("reduce_max", x, (1,))
    st = state_after(b.build(r), A2, MP({"x": 0}, axis="a"))
    assert s("{0:(a,)}", st, r)


@pytest.mark.parametrize("axis,tiled", [(0, "{}"), (1, "{0:(a,)}")])
def test_cumsum_blocks_only_its_scanned_axis(axis, tiled):
    b = ProgramBuilder()
    x = b.input("x", 8, 4)
    c = b.cumsum(x, axis)
    st = state_after(b.build(c), A2, MP({"x": 0}, axis="a"))
    assert s(tiled, st, c) and st.conflicts == []


def test_implicit_broadcast_operand_is_not_tiled():
    b = ProgramBuilder()
    x, y = b.input("x", 8, 4), b.input("y", 1, 4)
    z = b.binary("add", x, y)
    st = state_after(b.build(z), A2, MP({"x": 0}, axis="a"))
    assert s("{0:(a,)}", st, z) and s("{}", st, y)


def test_implicit_broadcast_operand_takes_the_shared_dim():
    b = ProgramBuilder()
    x, y = b.input("x", 8, 4), b.input("y", 1, 4)
    z = b.binary("add", x, y)
    st = state_after(b.build(z), A2, MP({"x": 1}, axis="a"))
    assert s("{1:(a,)}", st, z) and s("{1:(a,)}", st, y)


def test_scalar_operand_does_not_block_propagation():
    b = ProgramBuilder()
    x = b.input("x", 8, 4)
    z = b.binary("mul", x, lit(3.0))
    st = state_after(b.build(z), A2, MP({"x": 1}, axis="a"))
    assert s("{1:(a,)}", st, z)


def test_broadcast_in_dim_keeps_the_operand_dim():
    b = ProgramBuilder()
    x = b.input("x", 4)
    y = b.op("broadcast_in_dim", x, shape=(8, 4), broadcast_dimensions=(1,))
    st = state_after(b.build(y), A2, MP({"x": 0}, axis="a"))
    assert s("{1:(a,)}", st, y)


def test_reshape_split_carries_the_axis_to_the_major_part():
    b = ProgramBuilder()
    x = b.input("x", 8, 4)
    r = b.reshape(x, 2, 4, 4)
    st = state_after(b.build(r), A2, MP({"x": 0}, axis="a"))
    assert s("{0:(a,)}", st, r)


def test_reshape_split_partially_tiles_a_bigger_major_factor():
    b = ProgramBuilder()
    x = b.input("x", 8, 4)
    r = b.reshape(x, 4, 2, 4)
    st = state_after(b.build(r), A2, MP({"x": 0}, axis="a"))
    assert s("{0:(a,)}", st, r)


def test_reshape_split_spreads_two_axes_over_two_factors():
    b = ProgramBuilder()
    x = b.input("x", 8, 4)
    r = b.reshape(x, 2, 4, 4)
    st = state_after(b.build(r), AB, MP({"x": 0}, axis="a"), MP({"x": 0}, axis="b"))
    assert s("{0:(a,), 1:(b,)}", st, r)


def test_reshape_merge_puts_the_axis_on_the_merged_dim():
    b = ProgramBuilder()
    x = b.input("x", 2, 4, 4)
    r = b.reshape(x, 8, 4)
    st = state_after(b.build(r), A2, MP({"x": 0}, axis="a"))
    assert s("{0:(a,)}", st, r)


def test_reshape_when_the_axis_straddles_factors_is_left_alone():
    b = ProgramBuilder()
    x = b.input("x", 8)
    r = b.reshape(x, 2, 4)
    st = state_after(b.build(r), Mesh(a=4), MP({"x": 0}, axis="a"))
    assert s("{}", st, r) and st.conflicts == []


def test_reshape_minor_factor_alone_is_not_a_block_layout():
    b = ProgramBuilder()
    x = b.input("x", 2, 4)
    r = b.reshape(x, 8)
    st = state_after(b.build(r), A2, MP({"x": 1}, axis="a"))
    assert s("{}", st, r)
    (c,) = st.conflicts
    assert (c.axis, c.eqn) == ("a", 0)
    assert c.message == "reshape at test.py:0: tiling factor of size 4 by 'a' is not a block layout here"


def test_reshape_minor_factor_after_a_fully_tiled_major_one_is_a_block_layout():
    b = ProgramBuilder()
    x = b.input("x", 2, 4)
    r = b.reshape(x, 8)
    st = state_after(b.build(r), AB, MP({"x": 0}, axis="a"), MP({"x": 1}, axis="b"))
    assert s("{0:(a,b)}", st, r) and st.conflicts == []


@pytest.mark.parametrize("prim,params,shape", [
    ("slice", dict(start_indices=(0, 1), limit_indices=(8, 3), strides=None), (8, 2)),
    ("rev", dict(dimensions=(1,)), (8, 4)),
])
def test_windowed_ops_tile_the_untouched_dim_only(prim, params, shape):
    b = ProgramBuilder()
    x = b.input("x", 8, 4)
    y = b.op(prim, x, shape=shape, **params)
    st0 = state_after(b.build(y), A2, MP({"x": 0}, axis="a"))
    st1 = state_after(b.build(y), A2, MP({"x": 1}, axis="a"))
    assert s("{0:(a,)}", st0, y) and s("{}", st1, y) and st1.conflicts == []


def test_concatenate_tiles_both_operands_on_the_other_dim():
    b = ProgramBuilder()
    x, y = b.input("x", 8, 4), b.input("y", 8, 4)
    z = b.op("concatenate", x, y, shape=(8, 8), dimension=1)
    st = state_after(b.build(z), A2, MP({"x": 0}, axis="a"))
    assert s("{0:(a,)}", st, z) and s("{0:(a,)}", st, y)


def test_split_results_follow_the_untouched_dim():
    b = ProgramBuilder()
    x = b.input("x", 8, 4)
    p, q = b.op_n("split", x, shapes=[(8, 2), (8, 2)], sizes=(2, 2), axis=1)
    st = state_after(b.build(p, q), A2, MP({"x": 0}, axis="a"))
    assert s("{0:(a,)}", st, p) and s("{0:(a,)}", st, q)


def test_scatter_add_batch_tiling_reaches_the_indices_and_makes_the_result_partial():
    b = ProgramBuilder()
    acc, idx, upd = b.input("acc", 4, 6), b.input("idx", 6, 1, dtype="int32"), b.input("upd", 6, 6)
    dn = {"update_window_dims": (1,), "inserted_window_dims": (0,), "scatter_dims_to_operand_dims": (0,),
          "operand_batching_dims": (), "scatter_indices_batching_dims": ()}
    out = b.op("scatter-add", acc, idx, upd, shape=(4, 6), dimension_numbers=dn, indices_are_sorted=False,
               unique_indices=False, mode="FILL_OR_DROP")
    st = state_after(b.build(out), A2, MP({"upd": 0}, axis="a"))
    assert s("{0:(a,)}", st, idx) and s("{}", st, out) and s("{}", st, acc)
    assert st.result_sharding(0).partial == ("a",)


# -- earlier tactics win, conflicts with both origins -------------------------------------------
def test_later_tactic_cannot_retile_an_equation_the_earlier_one_fixed():
    prog, v = mlp()
    st = state_after(prog, A2, MP({"x": 0}, axis="a", name="bp"), MP({"w1": 0}, axis="a", name="late"))
    assert s("{0:(a,)}", st, v["h"]) and s("{0:(a,)}", st, v["w1"])
    (c,) = st.conflicts
    assert (c.axis, c.eqn) == ("a", 0)
    assert c.message == (f"dot_general at test.py:0: {v['w1']} (from late (input 'w1' dim 0)) wants another "
                         f"factor tiled by 'a' than the one the equation has (from bp (input 'x' dim 0))")


def test_two_seeds_of_one_tactic_wanting_different_factors_leave_the_equation_untiled():
    prog, v = mlp()
    st = state_after(prog, A2, MP({"x": 0, "w1": 1}, axis="a"))
    assert st.eqn_factors[0] == {} and s("{}", st, v["h"])
    (c,) = [c for c in st.conflicts if c.eqn == 0]
    assert c.message == (f"dot_general at test.py:0: {v['x']} (from tactic 0 (a) (input 'x' dim 0)) and "
                         f"{v['w1']} (from tactic 0 (a) (input 'w1' dim 1)) want different factors tiled by "
                         "'a'; left untiled")


def test_replicated_pin_stops_propagation_into_the_input():
    prog, v = mlp()
    st = state_after(prog, A2, MP({"x": 1, "w1": REPLICATED}, axis="a"))
    assert s("{}", st, v["w1"]) and st.pinned[v["w1"]] == {"a"}
    (c,) = st.conflicts
    assert (c.axis, c.eqn) == ("a", 0)
    assert c.message == f"dot_general at test.py:0: {v['w1']} is pinned REPLICATED on 'a'"
    # the equation keeps its contracting tiling: the lowering slices w1 locally
    (i,), (k,) = st.rules[0].operands[0]
    assert st.eqn_factors[0] == {k: ("a",)}


def test_pinned_value_may_still_be_tiled_on_another_axis():
    prog, v = mlp()
    st = state_after(prog, AB, MP({"w1": REPLICATED}, axis="a"), MP({"w1": 1}, axis="b"))
    assert s("{1:(b,)}", st, v["w1"]) and st.pinned[v["w1"]] == {"a"}


def test_producer_consistency_x_plus_y_transposed():
    b = ProgramBuilder()
    x, y = b.input("x", 4, 4), b.input("y", 4, 4)
    t = b.transpose(y, (1, 0))
    z = b.binary("add", x, t)
    st = state_after(b.build(z), A2, MP({"x": 0, "y": 0}, axis="a"))
    assert s("{1:(a,)}", st, t) and s("{0:(a,)}", st, z)     # t follows its producer, z its first operand
    (c,) = st.conflicts
    assert (c.axis, c.eqn) == ("a", 1)
    assert c.message == f"add at test.py:1: {t} dim 0: its producer [0] transpose cannot tile it by 'a'"


def test_producer_consistency_through_a_unary_op():
    b = ProgramBuilder()
    x, y = b.input("x", 4, 4), b.input("y", 4, 4)
    e = b.unary("exp", y)
    z = b.binary("add", x, e)
    st = state_after(b.build(z), A2, MP({"x": 0, "y": 1}, axis="a"))
    assert s("{1:(a,)}", st, e) and s("{0:(a,)}", st, z)
    assert [(c.eqn, c.message) for c in st.conflicts] == [
        (1, f"add at test.py:1: {e} dim 0: its producer [0] exp cannot tile it by 'a'")]


def test_value_tiled_on_another_axis_conflicts_with_the_equation():
    b = ProgramBuilder()
    x, y = b.input("x", 4, 4), b.input("y", 4, 4)
    u = b.transpose(y, (1, 0))
    z = b.binary("add", x, u)
    st = state_after(b.build(z), AB, MP({"x": 1, "y": 1}, axis="b"), MP({"x": 0}, axis="a"))
    assert s("{0:(b,)}", st, u) and s("{0:(a,), 1:(b,)}", st, x) and s("{0:(a,), 1:(b,)}", st, z)
    by_axis = {c.axis: c for c in st.conflicts}
    assert by_axis["b"].message == f"add at test.py:1: {u} dim 1: its producer [0] transpose cannot tile it by 'b'"
    assert by_axis["a"].message == f"add at test.py:1: {u} dim 0 is tiled ('b',), the equation wants ('a',)"


def test_a_conflict_is_recorded_once_per_equation_and_axis():
    b = ProgramBuilder()
    x, y = b.input("x", 4, 4), b.input("y", 4, 4)
    t = b.transpose(y, (1, 0))
    z = b.binary("add", x, t)
    z2 = b.binary("add", z, t)
    st = state_after(b.build(z2), A2, MP({"x": 0, "y": 0}, axis="a"))
    assert sorted((c.eqn, c.axis) for c in st.conflicts) == [(1, "a"), (2, "a")]


def test_conflicts_are_printed_with_the_state():
    b = ProgramBuilder()
    x, y = b.input("x", 4, 4), b.input("y", 4, 4)
    z = b.binary("add", x, b.transpose(y, (1, 0)))
    text = state_after(b.build(z), A2, MP({"x": 0, "y": 0}, axis="a", name="seed")).pretty()
    assert "# sharding state after 1 tactic(s): seed on Mesh(a=2)" in text
    assert "conflicts (1; left unpropagated, resharded at lowering):" in text
    assert "[1] a: add at test.py:1:" in text
    assert "x                                        f32[4,4]         {0:(a,)}   # a: seed (input 'x' dim 0)" in text


# -- errors -------------------------------------------------------------------------------------
def test_axis_used_twice_on_one_input():
    prog, _ = mlp()
    with pytest.raises(ShardingError, match=r"axis 'a' is used twice on input 'x': it already tiles dim 0 "
                                            r"\(\{0:\(a,\)\}, from tactic 0 \(a\) \(input 'x' dim 0\)\) "
                                            r"and the tactic asks for dim 1"):
        state_after(prog, A2, MP({"x": 0}, axis="a"), MP({"x": 1}, axis="a"))


def test_axis_used_twice_through_propagation_names_the_op():
    prog, _ = mlp()
    with pytest.raises(ShardingError, match=r"used twice on input 'w2'.*from tactic 0 \(a\) via dot_general"):
        state_after(prog, A2, MP({"w1": 1}, axis="a"), MP({"w2": 1}, axis="a"))


def test_same_seed_twice_is_a_no_op():
    prog, v = mlp()
    st = state_after(prog, A2, MP({"x": 0}, axis="a"), MP({"x": 0}, axis="a"))
    assert s("{0:(a,)}", st, v["x"]) and st.conflicts == []


@pytest.mark.parametrize("dim", [2, -3])
def test_dim_out_of_range(dim):
    prog, _ = mlp()
    with pytest.raises(TacticError, match=rf"dim {dim} is out of range for input 'x' of shape \(8, 4\) "
                                          r"\(rank 2\); use 0..1"):
        state_after(prog, A2, MP({"x": dim}, axis="a"))


def test_non_divisible_dim():
    prog, _ = mlp()
    with pytest.raises(ShardingError, match=r"dim 0 of input 'x' has size 8, which is not divisible by 16 "
                                            r"\(axes \('a',\) of Mesh\(a=16\)\)"):
        state_after(prog, Mesh(a=16), MP({"x": 0}, axis="a"))


def test_non_divisible_after_an_earlier_axis():
    prog, _ = mlp()
    with pytest.raises(ShardingError, match=r"size 4, which is not divisible by 8 \(axes \('a', 'b'\)"):
        state_after(prog, Mesh(a=2, b=4), MP({"x": 1}, axis="a"), MP({"x": 1}, axis="b"))


def test_pinned_then_tiled_on_the_same_axis():
    prog, _ = mlp()
    with pytest.raises(ShardingError, match="input 'x' was pinned REPLICATED on axis 'a' by an earlier tactic"):
        state_after(prog, A2, MP({"x": REPLICATED}, axis="a"), MP({"x": 0}, axis="a"))


def test_tiled_then_pinned_on_the_same_axis():
    prog, _ = mlp()
    with pytest.raises(ShardingError, match=r"input 'x' is already tiled by axis 'a' \(\{0:\(a,\)\}\); it cannot "
                                            "also be pinned REPLICATED on it"):
        state_after(prog, A2, MP({"x": 0}, axis="a"), MP({"x": REPLICATED}, axis="a"))


def test_unknown_axis():
    prog, _ = mlp()
    with pytest.raises(MeshError, match=r"axis 'z' is not in mesh Mesh\(a=2\)"):
        state_after(prog, A2, MP({"x": 0}, axis="z"))


def test_pattern_matching_nothing():
    prog, _ = mlp()
    with pytest.raises(TacticError, match="pattern 'params/\\*' matches no input"):
        state_after(prog, A2, MP({"params/*": 0}, axis="a"))
    st = state_after(prog, A2, MP({"params/*": 0}, axis="a", allow_unmatched=True))
    assert st.tactics_applied == ["tactic 0 (a)"] and st.conflicts == []


def test_mesh_must_be_a_mesh():
    prog, _ = mlp()
    with pytest.raises(MeshError, match="mesh must be a partir_emu.Mesh, got dict"):
        partition(prog, {"a": 2}, [])   # type: ignore[arg-type]


# -- AutomaticPartition: the cost is a parameter ------------------------------------------------
def test_automatic_partition_without_any_cost_says_what_to_pass():
    prog, _ = mlp()
    with pytest.raises(TacticError, match="no cost to search with; give the tactic cost=.*or pass cost_model="):
        state_after(prog, A2, AutomaticPartition("a", inputs="w*"))


def test_automatic_partition_uses_its_own_cost():
    prog, v = mlp()
    # price: bytes of w1 per device, so the search tiles w1
    def cost(spmd):
        return spmd.program.inputs[1].nbytes
    st = state_after(prog, A2, AutomaticPartition("a", inputs="w1", cost=cost))
    ((label, res),) = st.auto_results
    assert label == "auto:a" and res.decisions == {"w1": 0} and res.cost < res.baseline
    assert s("{0:(a,)}", st, v["w1"])


def test_automatic_partition_asks_the_cost_model_with_the_tactic():
    prog, v = mlp()
    seen = []

    def model(tactic):
        seen.append(tactic)
        return lambda spmd: 1.0      # every choice costs the same: keep none
    tactic = AutomaticPartition("a", inputs="w*", hardware="h100")
    st = state_after(prog, A2, tactic, cost_model=model)
    assert seen == [tactic] and st.auto_results[0][1].decisions == {}
    assert st.tactics_applied == ["auto:a (no decision paid off)"] and s("{}", st, v["w1"])

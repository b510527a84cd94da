"""Each sharding-rule family on hand-written equations: the factors of every dim, the blocked
factors, the reduction factors and the linear flag.

Rules are spelled as einsums (``helpers.spell``): factors are named a, b, c... in order of first
appearance over the operands then the results; a compound dim is parenthesised.
"""
from __future__ import annotations

import pytest

from partir_emu.core.factors import FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn, Literal, Var
from partir_emu.errors import UnsupportedPrimitiveError
from partir_emu.primitives import rule_for
from tests.unit.compiler.helpers import blocked, reduction, sizes, spell

_ids = iter(range(10**6))


def v(*shape: int, dtype: str = "float32") -> Var:
    return Var(next(_ids), tuple(shape), dtype)


def eqn(prim: str, ins, out_shapes, **params) -> Eqn:
    outs = tuple(v(*s) for s in out_shapes)
    return Eqn(prim, tuple(ins), outs, params, "test_rules.py")


def rule(prim: str, ins, out_shapes, **params) -> FactorRule:
    return rule_for(eqn(prim, ins, out_shapes, **params))


def dot(lhs: Var, rhs: Var, out, contract, batch=((), ())) -> FactorRule:
    return rule("dot_general", [lhs, rhs], [out], dimension_numbers=(contract, batch),
                preferred_element_type="float32")


# -- the vocabulary --------------------------------------------------------------------------
def test_reduction_factors_are_those_missing_from_every_result():
    b = RuleBuilder()
    i, k, j = b.new(8), b.new(4), b.new(6)
    r = b.rule([[(i,), (k,)], [(k,), (j,)]], [[(i,), (j,)]])
    assert r.reduction == frozenset({k}) and r.sizes == (8, 4, 6) and not r.linear


def test_rule_builder_blocks_size_one_factors():
    b = RuleBuilder()
    assert b.new(1) in b.blocked and b.new(4) not in b.blocked and b.new(4, blocked=True) in b.blocked


def test_missing_rule_names_the_primitive():
    with pytest.raises(UnsupportedPrimitiveError, match="primitive 'frobnicate' at test_rules.py"):
        rule("frobnicate", [v(4)], [(4,)])


# -- dot_general ------------------------------------------------------------------------------
def test_matmul_is_ik_kj_ij_with_k_a_reduction():
    r = dot(v(8, 4), v(4, 6), (8, 6), ((1,), (0,)))
    assert spell(r) == "ab,bc->ac"
    assert reduction(r) == "b" and blocked(r) == "" and not r.linear
    assert sizes(r) == {"a": 8, "b": 4, "c": 6}


def test_matmul_with_transposed_rhs_contracts_both_last_dims():
    r = dot(v(8, 4), v(6, 4), (8, 6), ((1,), (1,)))
    assert spell(r) == "ab,cb->ac" and reduction(r) == "b"


def test_batched_matmul_shares_the_batch_factor():
    r = dot(v(2, 3, 5), v(2, 5, 7), (2, 3, 7), ((2,), (1,)), ((0,), (0,)))
    assert spell(r) == "abc,acd->abd"
    assert reduction(r) == "c" and sizes(r)["a"] == 2


def test_two_contracting_dims_are_two_reduction_factors():
    r = dot(v(8, 4, 2), v(4, 2, 6), (8, 6), ((1, 2), (0, 1)))
    assert spell(r) == "abc,bcd->ad" and reduction(r) == "bc"


def test_outer_product_has_no_reduction():
    r = dot(v(8), v(6), (8, 6), ((), ()))
    assert spell(r) == "a,b->ab" and reduction(r) == ""


def test_matrix_vector_product():
    r = dot(v(8, 4), v(4), (8,), ((1,), (0,)))
    assert spell(r) == "ab,b->a" and reduction(r) == "b"


# -- elementwise ------------------------------------------------------------------------------
@pytest.mark.parametrize("prim", ["exp", "tanh", "neg", "log", "sqrt", "logistic", "abs"])
def test_unary_elementwise_maps_every_dim_to_itself(prim):
    r = rule(prim, [v(8, 4)], [(8, 4)])
    assert spell(r) == "ab->ab" and blocked(r) == "" and reduction(r) == ""


@pytest.mark.parametrize("prim", ["add", "sub", "mul", "div", "max", "min", "pow", "atan2"])
def test_binary_elementwise_shares_every_factor(prim):
    r = rule(prim, [v(8, 4), v(8, 4)], [(8, 4)])
    assert spell(r) == "ab,ab->ab" and reduction(r) == ""


@pytest.mark.parametrize("prim,linear", [("add", True), ("sub", True), ("neg", True), ("add_any", True),
                                         ("copy", True), ("mul", False), ("div", False), ("max", False),
                                         ("exp", False), ("integer_pow", False)])
def test_linear_flag_marks_ops_pending_sums_pass_through(prim, linear):
    n_in = 1 if prim in ("neg", "copy", "exp", "integer_pow") else 2
    r = rule(prim, [v(8, 4) for _ in range(n_in)], [(8, 4)])
    assert r.linear is linear


@pytest.mark.parametrize("new_dtype,linear", [("float32", True), ("bfloat16", True), ("int32", False)])
def test_convert_element_type_is_linear_only_to_floats(new_dtype, linear):
    assert rule("convert_element_type", [v(8, 4)], [(8, 4)], new_dtype=new_dtype).linear is linear


def test_scalar_operand_has_no_dims():
    r = rule("mul", [v(8, 4), Literal(2.0, "float32")], [(8, 4)])
    assert spell(r) == "ab,->ab" and r.operands[1] == ()


def test_zero_dim_var_operand_is_a_scalar_too():
    r = rule("add", [v(), v(8, 4)], [(8, 4)])
    assert spell(r) == ",ab->ab"


def test_implicit_size_one_broadcast_gets_a_blocked_size_one_factor():
    r = rule("add", [v(8, 4), v(1, 4)], [(8, 4)])
    assert spell(r) == "ab,cb->ab"
    assert blocked(r) == "c" and sizes(r)["c"] == 1


def test_select_n_shares_factors_across_three_operands():
    r = rule("select_n", [v(8, 4, dtype="bool"), v(8, 4), v(8, 4)], [(8, 4)])
    assert spell(r) == "ab,ab,ab->ab" and not r.linear


# -- reductions and scans ---------------------------------------------------------------------
def test_reduce_sum_is_linear_with_a_reduction_factor():
    r = rule("reduce_sum", [v(8, 4)], [(8,)], axes=(1,))
    assert spell(r) == "ab->a"
    assert reduction(r) == "b" and blocked(r) == "" and r.linear


def test_reduce_sum_over_every_dim():
    r = rule("reduce_sum", [v(8, 4)], [()], axes=(0, 1))
    assert spell(r) == "ab->" and reduction(r) == "ab" and blocked(r) == ""


def test_reduce_sum_over_the_leading_dim():
    r = rule("reduce_sum", [v(8, 4, 2)], [(4, 2)], axes=(0,))
    assert spell(r) == "abc->bc" and reduction(r) == "a"


@pytest.mark.parametrize("prim", ["reduce_prod", "reduce_and"])
def test_non_sum_reductions_block_the_reduced_dim(prim):
    r = rule(prim, [v(8, 4)], [(8,)], axes=(1,))
    assert spell(r) == "ab->a" and blocked(r) == "b" and not r.linear


@pytest.mark.parametrize("prim,op", [("reduce_max", "max"), ("reduce_min", "min"), ("reduce_sum", "sum")])
def test_max_min_and_sum_reduce_a_tileable_dim_by_their_op(prim, op):
    r = rule(prim, [v(8, 4)], [(8,)], axes=(1,))
    assert spell(r) == "ab->a" and blocked(r) == "" and r.reduce_op == op and r.linear == (op == "sum")


@pytest.mark.parametrize("prim", ["argmax", "argmin"])
def test_arg_reductions_block_the_reduced_dim(prim):
    r = rule(prim, [v(8, 4)], [(4,)], axes=(0,), index_dtype="int32")
    assert spell(r) == "ab->b" and blocked(r) == "a"


@pytest.mark.parametrize("prim", ["cumsum", "cumprod", "cummax", "cummin"])
@pytest.mark.parametrize("axis,want", [(0, "a"), (1, "b")])
def test_scans_block_the_scanned_axis(prim, axis, want):
    r = rule(prim, [v(8, 4)], [(8, 4)], axis=axis, reverse=False)
    assert spell(r) == "ab->ab" and blocked(r) == want and reduction(r) == ""


# -- reshape: compound factors ---------------------------------------------------------------
def reshape(ishape, oshape) -> FactorRule:
    return rule("reshape", [v(*ishape)], [oshape], new_sizes=tuple(oshape), dimensions=None)


def test_reshape_split_makes_the_input_dim_compound():
    r = reshape((8, 4), (2, 4, 4))
    assert spell(r) == "(ab)c->abc"
    assert sizes(r) == {"a": 2, "b": 4, "c": 4} and blocked(r) == "" and r.linear


def test_reshape_merge_makes_the_output_dim_compound():
    r = reshape((2, 4, 4), (8, 4))
    assert spell(r) == "abc->(ab)c" and sizes(r) == {"a": 2, "b": 4, "c": 4}


def test_reshape_flatten():
    r = reshape((4, 6), (24,))
    assert spell(r) == "ab->(ab)" and blocked(r) == ""


def test_reshape_unflatten_uneven():
    r = reshape((12,), (3, 4))
    assert spell(r) == "(ab)->ab" and sizes(r) == {"a": 3, "b": 4}


def test_reshape_partial_overlap_refines_both_sides():
    r = reshape((6, 4), (2, 12))
    assert spell(r) == "(ab)c->a(bc)" and sizes(r) == {"a": 2, "b": 3, "c": 4}


@pytest.mark.parametrize("ishape,oshape", [((2, 3), (3, 2)), ((6, 4), (4, 6))])
def test_reshape_without_contiguous_refinement_blocks_everything(ishape, oshape):
    r = reshape(ishape, oshape)
    assert spell(r) == "ab->cd" and blocked(r) == "abcd"


def test_reshape_keeps_the_refinable_prefix_tileable():
    r = reshape((8, 2, 3), (8, 3, 2))
    assert spell(r) == "abc->ade" and blocked(r) == "bcde"


def test_reshape_drops_a_size_one_dim():
    r = reshape((8, 1, 4), (8, 4))
    assert spell(r) == "abc->ac" and blocked(r) == "b"


def test_reshape_adds_a_size_one_dim():
    r = reshape((8, 4), (8, 1, 4))
    assert spell(r) == "ab->acb" and blocked(r) == "c"


# -- transpose, broadcast, squeeze, expand_dims --------------------------------------------
@pytest.mark.parametrize("perm,want", [((1, 0), "ab->ba"), ((2, 0, 1), "abc->cab"), ((0, 2, 1), "abc->acb")])
def test_transpose_permutes_factors(perm, want):
    x = v(2, 3, 4) if len(perm) == 3 else v(2, 3)
    r = rule("transpose", [x], [tuple(x.shape[p] for p in perm)], permutation=perm)
    assert spell(r) == want and r.linear and blocked(r) == ""


def test_broadcast_in_dim_adds_a_fresh_factor():
    r = rule("broadcast_in_dim", [v(4)], [(8, 4)], shape=(8, 4), broadcast_dimensions=(1,))
    assert spell(r) == "a->ba" and blocked(r) == "" and reduction(r) == ""


def test_broadcast_in_dim_of_a_size_one_dim_is_blocked_on_the_operand():
    r = rule("broadcast_in_dim", [v(1, 4)], [(8, 4)], shape=(8, 4), broadcast_dimensions=(0, 1))
    assert spell(r) == "ab->cb" and blocked(r) == "a" and sizes(r)["c"] == 8


def test_broadcast_in_dim_of_a_scalar():
    r = rule("broadcast_in_dim", [v()], [(4, 6)], shape=(4, 6), broadcast_dimensions=())
    assert spell(r) == "->ab" and blocked(r) == ""


def test_squeeze_drops_a_size_one_factor():
    r = rule("squeeze", [v(1, 8, 4)], [(8, 4)], dimensions=(0,))
    assert spell(r) == "abc->bc" and blocked(r) == "a" and r.linear


def test_squeeze_negative_dimension():
    r = rule("squeeze", [v(8, 4, 1)], [(8, 4)], dimensions=(-1,))
    assert spell(r) == "abc->ab"


def test_expand_dims_adds_a_size_one_factor():
    r = rule("expand_dims", [v(8, 4)], [(1, 8, 4)], dimensions=(0,))
    assert spell(r) == "ab->cab" and blocked(r) == "c" and r.linear


# -- windowed ops: the changed dims are blocked -------------------------------------------
def test_concatenate_blocks_the_concatenated_dim():
    r = rule("concatenate", [v(8, 4), v(8, 4)], [(16, 4)], dimension=0)
    assert spell(r) == "ab,cb->db" and blocked(r) == "acd"


def test_concatenate_along_the_minor_dim():
    r = rule("concatenate", [v(8, 4), v(8, 2)], [(8, 6)], dimension=1)
    assert spell(r) == "ab,ac->ad" and blocked(r) == "bcd" and sizes(r)["c"] == 2


def test_slice_blocks_the_sliced_dim():
    r = rule("slice", [v(8, 4)], [(8, 2)], start_indices=(0, 1), limit_indices=(8, 3), strides=None)
    assert spell(r) == "ab->ac" and blocked(r) == "bc"


def test_full_slice_blocks_nothing():
    r = rule("slice", [v(8, 4)], [(8, 4)], start_indices=(0, 0), limit_indices=(8, 4), strides=None)
    assert spell(r) == "ab->ab" and blocked(r) == ""


def test_strided_slice_blocks_the_strided_dim():
    r = rule("slice", [v(8, 4)], [(4, 4)], start_indices=(0, 0), limit_indices=(8, 4), strides=(2, 1))
    assert spell(r) == "ab->cb" and blocked(r) == "ac"


def test_pad_blocks_the_padded_dim():
    r = rule("pad", [v(8, 4), Literal(0.0, "float32")], [(10, 4)], padding_config=((1, 1, 0), (0, 0, 0)))
    assert spell(r) == "ab,->cb" and blocked(r) == "ac"


def test_rev_blocks_the_reversed_dim():
    r = rule("rev", [v(8, 4)], [(8, 4)], dimensions=(0,))
    assert spell(r) == "ab->cb" and blocked(r) == "ac"


def test_dynamic_slice_blocks_the_sliced_dim_and_ignores_indices():
    r = rule("dynamic_slice", [v(8, 4), v(dtype="int32"), v(dtype="int32")], [(8, 2)], slice_sizes=(8, 2))
    assert spell(r) == "ab,,->ac" and blocked(r) == "bc"


def test_dynamic_update_slice_blocks_the_updated_dim():
    r = rule("dynamic_update_slice", [v(8, 4), v(8, 2), v(dtype="int32"), v(dtype="int32")], [(8, 4)])
    assert spell(r) == "ab,ac,,->ad" and blocked(r) == "bcd"


def test_split_blocks_the_split_axis_on_every_result():
    r = rule("split", [v(8, 4)], [(8, 2), (8, 2)], sizes=(2, 2), axis=1)
    assert spell(r) == "ab->ac,ad" and blocked(r) == "bcd"


def test_iota_is_blocked_everywhere():
    r = rule("iota", [], [(8, 4)], dtype="int32", shape=(8, 4), dimension=0)
    assert spell(r) == "->ab" and blocked(r) == "ab"


# -- gather and scatter-add -----------------------------------------------------------------
GATHER_DN = {"offset_dims": (1,), "collapsed_slice_dims": (0,), "start_index_map": (0,),
             "operand_batching_dims": (), "start_indices_batching_dims": ()}
SCATTER_DN = {"update_window_dims": (1,), "inserted_window_dims": (0,), "scatter_dims_to_operand_dims": (0,),
              "operand_batching_dims": (), "scatter_indices_batching_dims": ()}


def test_gather_rows_shares_the_row_width_and_the_batch():
    r = rule("gather", [v(4, 6), v(5, 1, dtype="int32")], [(5, 6)], dimension_numbers=GATHER_DN,
             slice_sizes=(1, 6), mode="FILL_OR_DROP", fill_value=None)
    assert spell(r) == "ab,cd->cb"
    # the gathered dim and the index vector do not reach the result, but are blocked: never partial
    assert blocked(r) == "ad" and reduction(r) == "ad" and r.partial_operands == ()


def test_gather_of_a_partial_window_blocks_it():
    r = rule("gather", [v(4, 6), v(5, 1, dtype="int32")], [(5, 3)], dimension_numbers=GATHER_DN,
             slice_sizes=(1, 3), mode="FILL_OR_DROP", fill_value=None)
    assert spell(r) == "ab,cd->ce" and blocked(r) == "abde"


def test_scatter_add_batch_is_a_reduction_and_the_accumulator_takes_partials():
    r = rule("scatter-add", [v(4, 6), v(5, 1, dtype="int32"), v(5, 6)], [(4, 6)], dimension_numbers=SCATTER_DN,
             indices_are_sorted=False, unique_indices=False, mode="FILL_OR_DROP")
    assert spell(r) == "ab,cd,cb->ab"
    # the scattered dim "a" is a row lookup: tileable (each device applies its block's updates)
    assert reduction(r) == "cd" and blocked(r) == "d"
    assert r.partial_operands == (0,) and sizes(r)["c"] == 5

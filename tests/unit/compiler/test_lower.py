"""Lowering: the reshard planner's choice of collectives, and the local shapes and parameters of
the SpmdProgram. Each test names the exact collectives (kind, axes, dims) the program must hold."""
from __future__ import annotations

import pytest

from partir_emu.compiler.api import partition_and_lower
from partir_emu.compiler.lowering.lower import lower
from partir_emu.compiler.tactics import REPLICATED, AutomaticPartition
from partir_emu.compiler.tactics import ManualPartition as MP
from partir_emu.core.ir import verify
from partir_emu.core.mesh import Mesh
from partir_emu.core.sharding import Sharding
from partir_emu.errors import LoweringError
from tests.unit.compiler.helpers import ProgramBuilder, collectives, lowered, state_after

A2 = Mesh(a=2)
AB = Mesh(a=2, b=2)
SCATTER_DN = {"update_window_dims": (1,), "inserted_window_dims": (0,), "scatter_dims_to_operand_dims": (0,),
              "operand_batching_dims": (), "scatter_indices_batching_dims": ()}


def matmul_program():
    b = ProgramBuilder()
    x, w = b.input("x", 8, 4), b.input("w", 4, 6)
    return b, x, w, b.matmul(x, w)


def eqn_of(spmd, prim):
    (e,) = [e for e in spmd.program.eqns if e.prim == prim]
    return e


# -- pending sums -------------------------------------------------------------------------------
def test_partial_result_is_all_reduced_at_the_output():
    b, x, w, y = matmul_program()
    spmd = lowered(b.build(y), A2, MP({"x": 1}, axis="a"))
    assert collectives(spmd) == [("all_reduce", ("a",), "sum")]
    assert eqn_of(spmd, "all_reduce").inputs[0].shape == (8, 6)
    verify(spmd.program)


def test_partial_with_a_consumer_tiled_on_the_same_axis_is_reduce_scattered():
    b, x, w, y = matmul_program()
    q = b.input("q", 8, 6)
    z = b.binary("add", y, q)
    spmd = lowered(b.build(z), A2, MP({"x": 1, "q": 0}, axis="a"))
    assert collectives(spmd) == [("reduce_scatter", ("a",), 0)]    # never all_reduce + slice
    rs = eqn_of(spmd, "reduce_scatter")
    assert rs.inputs[0].shape == (8, 6) and rs.outputs[0].shape == (4, 6)
    assert spmd.out_shardings == (Sharding((("a",), ())),)


def test_partial_over_two_axes_reduce_scatters_one_then_all_reduces_the_shard_over_the_other():
    """The all-reduce over ``b`` runs on the buffer the reduce-scatter over ``a`` has shrunk (a
    gradient sharded inside a slice and replicated across slices sends only its shard over DCN)."""
    b, x, w, y = matmul_program()
    q = b.input("q", 8, 6)
    z = b.binary("add", y, q)
    spmd = lowered(b.build(z), AB, MP({"x": 1, "q": 0}, axis="a"), MP({"x": 1}, axis="b"))
    assert collectives(spmd) == [("reduce_scatter", ("a",), 0), ("all_reduce", ("b",), "sum")]
    assert eqn_of(spmd, "all_reduce").inputs[0].shape == (4, 6)
    verify(spmd.program)


def test_partial_over_two_axes_reduce_scattered_on_both():
    b, x, w, y = matmul_program()
    q = b.input("q", 8, 6)
    z = b.binary("add", y, q)
    spmd = lowered(b.build(z), AB, MP({"x": 1, "q": 0}, axis="a"), MP({"x": 1, "q": 0}, axis="b"))
    assert collectives(spmd) == [("reduce_scatter", ("a", "b"), 0)]
    assert eqn_of(spmd, "reduce_scatter").outputs[0].shape == (2, 6)


def test_two_partial_axes_are_all_reduced_together_in_mesh_order():
    b, x, w, y = matmul_program()
    spmd = lowered(b.build(y), AB, MP({"x": 1}, axis="b"), MP({"x": 1}, axis="a"))
    assert collectives(spmd) == [("all_reduce", ("a", "b"), "sum")]


def test_partial_sums_pass_through_a_linear_add():
    b = ProgramBuilder()
    x1, w1, x2, w2 = b.input("x1", 8, 4), b.input("w1", 4, 6), b.input("x2", 8, 4), b.input("w2", 4, 6)
    z = b.binary("add", b.matmul(x1, w1), b.matmul(x2, w2))
    spmd = lowered(b.build(z), A2, MP({"x1": 1, "x2": 1}, axis="a"))
    assert collectives(spmd) == [("all_reduce", ("a",), "sum")]
    assert [e.prim for e in spmd.program.eqns] == ["dot_general", "dot_general", "add", "all_reduce"]


def test_partial_read_by_a_nonlinear_op_is_resolved_once_for_every_reader():
    b, x, w, y = matmul_program()
    z1 = b.unary("exp", y)
    z2 = b.binary("add", y, y)
    spmd = lowered(b.build(z1, z2), A2, MP({"x": 1}, axis="a"))
    assert collectives(spmd) == [("all_reduce", ("a",), "sum")]
    ar = eqn_of(spmd, "all_reduce").outputs[0]
    assert all(ar in e.inputs for e in spmd.program.eqns if e.prim in ("exp", "add"))


def test_reduce_sum_over_a_tiled_dim_is_all_reduced_once_at_the_output():
    b = ProgramBuilder()
    x = b.input("x", 8, 4)
    r = b.reduce("reduce_sum", x, (0,))
    spmd = lowered(b.build(r), A2, MP({"x": 0}, axis="a"))
    assert collectives(spmd) == [("all_reduce", ("a",), "sum")]
    assert eqn_of(spmd, "reduce_sum").inputs[0].shape == (4, 4)


def test_megatron_mlp_has_one_all_reduce_on_the_smallest_buffer():
    b = ProgramBuilder()
    x, w1, w2 = b.input("x", 8, 4), b.input("w1", 4, 16), b.input("w2", 16, 4)
    y = b.matmul(b.unary("tanh", b.matmul(x, w1)), w2)
    loss = b.reduce("reduce_sum", y, (1,))
    spmd = lowered(b.build(loss), A2, MP({"w1": 1}, axis="a"))
    # the partial y passes through the (linear) reduce_sum: the all_reduce moves 8 floats, not 32
    assert collectives(spmd) == [("all_reduce", ("a",), "sum")]
    assert eqn_of(spmd, "all_reduce").inputs[0].shape == (8,)


def test_batch_and_model_axes_reduce_over_the_model_axis_only():
    b = ProgramBuilder()
    x, w1, w2 = b.input("x", 8, 4), b.input("w1", 4, 16), b.input("w2", 16, 4)
    y = b.matmul(b.unary("tanh", b.matmul(x, w1)), w2)
    spmd = lowered(b.build(y), AB, MP({"x": 0}, axis="a"), MP({"w1": 1}, axis="b"))
    assert collectives(spmd) == [("all_reduce", ("b",), "sum")]
    assert eqn_of(spmd, "all_reduce").inputs[0].shape == (4, 4)


def test_partial_is_reduced_before_the_gather_on_the_smaller_buffer():
    b, x, w, y = matmul_program()
    c = b.cumsum(y, 0)
    spmd = lowered(b.build(c), AB, MP({"x": 0}, axis="a"), MP({"x": 1}, axis="b"))
    assert collectives(spmd) == [("all_reduce", ("b",), "sum"), ("all_gather", ("a",), 0)]
    assert eqn_of(spmd, "all_reduce").inputs[0].shape == (4, 6)


# -- tiling changes -----------------------------------------------------------------------------
def test_moving_an_axis_between_dims_is_one_all_to_all():
    b = ProgramBuilder()
    x, y = b.input("x", 4, 4), b.input("y", 4, 4)
    z = b.binary("add", x, b.transpose(y, (1, 0)))
    spmd = lowered(b.build(z), A2, MP({"x": 0, "y": 0}, axis="a"))
    assert collectives(spmd) == [("all_to_all", ("a",), 0, 1)]
    a2a = eqn_of(spmd, "all_to_all")
    assert a2a.inputs[0].shape == (4, 2) and a2a.outputs[0].shape == (2, 4)


def test_blocked_scan_gathers_the_scanned_dim():
    b = ProgramBuilder()
    x = b.input("x", 8, 4)
    c = b.cumsum(x, 0)
    spmd = lowered(b.build(c), A2, MP({"x": 0}, axis="a"))
    assert collectives(spmd) == [("all_gather", ("a",), 0)]
    assert eqn_of(spmd, "cumsum").inputs[0].shape == (8, 4)


def test_gather_of_the_minor_of_two_axes():
    b = ProgramBuilder()
    x = b.input("x", 8, 4)
    c = b.cumsum(x, 0)
    spmd = lowered(b.build(c), AB, MP({"x": 0}, axis="a"), MP({"x": 0}, axis="b"))
    assert collectives(spmd) == [("all_gather", ("a", "b"), 0)]


def test_reshape_the_axis_cannot_follow_gathers_first():
    b = ProgramBuilder()
    x = b.input("x", 8)
    r = b.reshape(x, 2, 4)
    spmd = lowered(b.build(r), Mesh(a=4), MP({"x": 0}, axis="a"))
    assert collectives(spmd) == [("all_gather", ("a",), 0)]


def test_reshape_without_block_layout_gathers_the_minor_dim():
    b = ProgramBuilder()
    x = b.input("x", 2, 4)
    r = b.reshape(x, 8)
    spmd = lowered(b.build(r), A2, MP({"x": 1}, axis="a"))
    assert collectives(spmd) == [("all_gather", ("a",), 1)]


def test_pinned_operand_is_sliced_locally_then_the_partial_reduced():
    b, x, w, y = matmul_program()
    spmd = lowered(b.build(y), A2, MP({"x": 1, "w": REPLICATED}, axis="a"))
    assert collectives(spmd) == [("all_slice", ("a",), 0), ("all_reduce", ("a",), "sum")]
    assert spmd.in_shardings[1] == Sharding(((), ())) and spmd.program.inputs[1].shape == (4, 6)
    assert eqn_of(spmd, "all_slice").outputs[0].shape == (2, 6)
    assert spmd.stats().count == {"all_reduce": 1}          # all_slice moves no data


def test_target_extending_the_common_prefix_is_an_all_slice_of_the_new_axis():
    b = ProgramBuilder()
    x, y = b.input("x", 8, 4), b.input("y", 8, 4)
    z = b.binary("add", x, y)
    spmd = lowered(b.build(z), AB, MP({"x": 0, "y": 0}, axis="a"), MP({"y": 0, "x": REPLICATED}, axis="b"))
    assert collectives(spmd) == [("all_slice", ("b",), 0)]
    assert eqn_of(spmd, "all_slice").inputs[0].shape == (4, 4) and eqn_of(spmd, "add").inputs[0].shape == (2, 4)


def test_pure_batch_parallel_forward_needs_no_collective():
    b = ProgramBuilder()
    x, w1, w2 = b.input("x", 8, 4), b.input("w1", 4, 16), b.input("w2", 16, 4)
    y = b.matmul(b.unary("tanh", b.matmul(x, w1)), w2)
    spmd = lowered(b.build(y), A2, MP({"x": 0}, axis="a"))
    assert collectives(spmd) == [] and spmd.stats().count == {}
    assert spmd.out_shardings == (Sharding((("a",), ())),)


# -- scatter-add accumulators -------------------------------------------------------------------
def scatter_program():
    b = ProgramBuilder()
    acc, idx, upd = b.input("acc", 4, 6), b.input("idx", 6, 1, dtype="int32"), b.input("upd", 6, 6)
    out = b.op("scatter-add", acc, idx, upd, shape=(4, 6), dimension_numbers=SCATTER_DN, indices_are_sorted=False,
               unique_indices=False, mode="FILL_OR_DROP")
    return b, out


def test_scatter_add_accumulator_becomes_partial_and_the_result_is_reduced():
    b, out = scatter_program()
    spmd = lowered(b.build(out), A2, MP({"upd": 0}, axis="a"))
    assert collectives(spmd) == [("to_partial", ("a",)), ("all_reduce", ("a",), "sum")]
    sc = eqn_of(spmd, "scatter-add")
    assert sc.inputs[0] is eqn_of(spmd, "to_partial").outputs[0]
    assert [a.shape for a in sc.inputs] == [(4, 6), (3, 1), (3, 6)]


def test_scatter_add_tiled_on_the_window_needs_no_partial():
    b, out = scatter_program()
    spmd = lowered(b.build(out), A2, MP({"upd": 1}, axis="a"))
    assert collectives(spmd) == []
    assert spmd.in_shardings[0] == Sharding(((), ("a",))) and spmd.out_shardings[0] == Sharding(((), ("a",)))


# -- ZeRO-3: gathered inputs are not kept ---------------------------------------------------------
def test_input_gathers_are_repeated_at_each_use():
    b = ProgramBuilder()
    w = b.input("w", 8, 4)
    c1, c2 = b.cumsum(w, 0), b.cumsum(w, 0)
    spmd = lowered(b.build(c1, c2), A2, MP({"w": 0}, axis="a"))
    assert collectives(spmd) == [("all_gather", ("a",), 0), ("all_gather", ("a",), 0)]


def test_gathers_of_computed_values_are_cached():
    b = ProgramBuilder()
    w = b.input("w", 8, 4)
    e = b.unary("exp", w)
    c1, c2 = b.cumsum(e, 0), b.cumsum(e, 0)
    spmd = lowered(b.build(c1, c2), A2, MP({"w": 0}, axis="a"))
    assert collectives(spmd) == [("all_gather", ("a",), 0)]


def test_reduce_scatter_of_a_computed_value_is_cached_across_readers():
    b, x, w, y = matmul_program()
    q = b.input("q", 8, 6)
    z1, z2 = b.binary("add", y, q), b.binary("sub", y, q)
    spmd = lowered(b.build(z1, z2), A2, MP({"x": 1, "q": 0}, axis="a"))
    assert collectives(spmd) == [("reduce_scatter", ("a",), 0)]


# -- outputs ------------------------------------------------------------------------------------
def state_program():
    b = ProgramBuilder()
    w = b.input("params/w", 4, 4)
    return b, b.build(b.transpose(w, (1, 0)), names=["1/w"])


def test_outputs_keep_the_sharding_they_have_by_default():
    b, prog = state_program()
    spmd = lowered(prog, A2, MP({"params/w": 0}, axis="a"))
    assert collectives(spmd) == [] and spmd.out_shardings == (Sharding(((), ("a",))),)


def test_state_outputs_are_laid_out_like_the_input_they_replace():
    b, prog = state_program()
    spmd = lowered(prog, A2, MP({"params/w": 0}, axis="a"), state_outputs={"1": "params"})
    assert collectives(spmd) == [("all_to_all", ("a",), 0, 1)]
    assert spmd.out_shardings == (Sharding((("a",), ())),) == spmd.in_shardings


def test_state_output_without_its_input_is_an_error():
    b = ProgramBuilder()
    w = b.input("params/w", 4, 4)
    prog = b.build(b.unary("exp", w), names=["1/v"])
    with pytest.raises(LoweringError, match="output '1/v' should mirror input 'params/v', which does not exist"):
        lowered(prog, A2, state_outputs={"1": "params"})


def test_state_output_of_another_shape_is_an_error():
    b = ProgramBuilder()
    w = b.input("params/w", 4, 4)
    prog = b.build(b.reduce("reduce_sum", w, (0,)), names=["1/w"])
    with pytest.raises(LoweringError, match=r"output '1/w' \(4,\) cannot mirror input 'params/w' \(4, 4\)"):
        lowered(prog, A2, state_outputs={"1": "params"})


# -- local shapes and parameters ----------------------------------------------------------------
def test_inputs_take_local_shapes_and_keep_global_ones_in_the_header():
    b, x, w, y = matmul_program()
    spmd = lowered(b.build(y), AB, MP({"x": 0}, axis="a"), MP({"w": 1}, axis="b"))
    assert [v.shape for v in spmd.program.inputs] == [(4, 4), (4, 3)]
    assert spmd.global_in_shapes == ((8, 4), (4, 6)) and spmd.global_out_shapes == ((8, 6),)
    assert spmd.in_shardings == (Sharding((("a",), ())), Sharding(((), ("b",))))
    assert eqn_of(spmd, "dot_general").outputs[0].shape == (4, 3)


def test_reshape_new_sizes_are_local():
    b = ProgramBuilder()
    x = b.input("x", 8, 4)
    r = b.reshape(x, 2, 4, 4)
    e = eqn_of(lowered(b.build(r), A2, MP({"x": 0}, axis="a")), "reshape")
    assert e.params["new_sizes"] == (1, 4, 4) == e.outputs[0].shape


def test_broadcast_shape_is_local():
    b = ProgramBuilder()
    x = b.input("x", 4)
    y = b.op("broadcast_in_dim", x, shape=(8, 4), broadcast_dimensions=(1,))
    e = eqn_of(lowered(b.build(y), A2, MP({"x": 0}, axis="a")), "broadcast_in_dim")
    assert e.params["shape"] == (8, 2) and e.params["broadcast_dimensions"] == (1,)


def test_dynamic_slice_sizes_are_local():
    b = ProgramBuilder()
    x, i = b.input("x", 8, 4), b.input("i", dtype="int32")
    y = b.op("dynamic_slice", x, i, i, shape=(8, 2), slice_sizes=(8, 2))
    e = eqn_of(lowered(b.build(y), A2, MP({"x": 0}, axis="a")), "dynamic_slice")
    assert e.params["slice_sizes"] == (4, 2)


def test_slice_limits_are_local_on_the_tiled_dim_only():
    b = ProgramBuilder()
    x = b.input("x", 8, 4)
    y = b.op("slice", x, shape=(8, 2), start_indices=(0, 1), limit_indices=(8, 3), strides=None)
    e = eqn_of(lowered(b.build(y), A2, MP({"x": 0}, axis="a")), "slice")
    assert e.params["limit_indices"] == (4, 3) and e.params["start_indices"] == (0, 1)


def test_gather_slice_sizes_are_local_on_the_tiled_window():
    b = ProgramBuilder()
    x, idx = b.input("x", 4, 6), b.input("idx", 5, 1, dtype="int32")
    dn = {"offset_dims": (1,), "collapsed_slice_dims": (0,), "start_index_map": (0,),
          "operand_batching_dims": (), "start_indices_batching_dims": ()}
    y = b.op("gather", x, idx, shape=(5, 6), dimension_numbers=dn, slice_sizes=(1, 6), mode="FILL_OR_DROP",
             fill_value=None, unique_indices=False, indices_are_sorted=False)
    spmd = lowered(b.build(y), A2, MP({"x": 1}, axis="a"))
    e = eqn_of(spmd, "gather")
    assert collectives(spmd) == [] and e.params["slice_sizes"] == (1, 3) and e.outputs[0].shape == (5, 3)


def test_iota_stays_global_and_is_sliced_for_a_tiled_consumer():
    b = ProgramBuilder()
    x = b.input("x", 8)
    i = b.op("iota", shape=(8,), dtype="float32", dimension=0)
    z = b.binary("add", x, i)
    spmd = lowered(b.build(z), A2, MP({"x": 0}, axis="a"))
    assert eqn_of(spmd, "iota").params["shape"] == (8,)
    assert collectives(spmd) == [("all_slice", ("a",), 0)]


# -- stats and the compiler entry point -----------------------------------------------------------
def test_stats_count_bytes_and_axes():
    b, x, w, y = matmul_program()
    q = b.input("q", 8, 6)
    z = b.binary("add", y, q)
    st = lowered(b.build(z, y), A2, MP({"x": 1, "q": 0}, axis="a")).stats()
    assert st.count == {"reduce_scatter": 1, "all_reduce": 1}
    assert st.bytes == {"reduce_scatter": 8 * 6 * 4, "all_reduce": 8 * 6 * 4}
    assert st.by_axes == {"a": {"count": 2, "bytes": 2 * 8 * 6 * 4}}


def test_lower_program_records_the_tactics_and_replays_states_with_the_cost_model():
    b, x, w, y = matmul_program()
    calls = []

    def model(tactic):
        calls.append(tactic.axis)
        return lambda spmd: float(sum(v.nbytes for v in spmd.program.inputs))
    low = partition_and_lower(b.build(y), AB, [MP({"x": 0}, axis="a"), AutomaticPartition("b", inputs="w")],
                        cost_model=model)
    assert low.spmd.meta["tactics"] == ["tactic 0 (a)", "auto:b"]
    assert low.final_state.auto_results[0][1].decisions == {"w": 0}
    # w's rows are the contracting dim: x follows on its columns, and the product is reduced over b
    assert collectives(low.spmd) == [("all_reduce", ("b",), "sum")]
    assert low.spmd.in_shardings[0] == Sharding((("a",), ("b",)))
    # the replay applies the recorded search result: no second search (a time-capped one could differ)
    assert len(low.states) == 3 and calls == ["b"]
    assert low.states[-1].value_dims == low.final_state.value_dims
    assert low.states[-1].auto_results == low.final_state.auto_results


def test_lowering_the_state_directly_equals_lower_program():
    b, x, w, y = matmul_program()
    prog = b.build(y)
    direct = lower(state_after(prog, A2, MP({"x": 1}, axis="a")))
    assert direct.pretty() == partition_and_lower(prog, A2, [MP({"x": 1}, axis="a")]).spmd.pretty()

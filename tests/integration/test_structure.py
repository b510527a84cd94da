"""Structural assertions on lowered programs: which collectives, how many, over which axes."""
from collections import Counter

import pytest

from partir_emu import Mesh
from partir_emu.api import lower_program
from partir_emu.core.ir import Var
from scenarios.common import STATE_OUTPUTS

LAYERS = 3


def lowered(case, scenario, strategy, mesh):
    s, cfg, prog, _, _ = case(scenario, f"layers={LAYERS}")
    m = Mesh.parse(mesh)
    return cfg, lower_program(prog, m, s.strategy(strategy, m, cfg), STATE_OUTPUTS)


def comms(low):
    return [e for e in low.spmd.program.eqns if e.prim in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")]


def params_of(low):
    return [(n, v) for n, v in zip(low.spmd.input_names, low.program.inputs) if n.startswith("params/")]


@pytest.mark.slow
def test_mp_transformer_two_allreduces_per_layer_each_way(case):
    cfg, low = lowered(case, "transformer", "mp", "batch=2,model=2")
    cs = comms(low)
    assert {e.prim for e in cs} == {"all_reduce"}
    assert all(e.params["axes"] == ("model",) for e in cs)
    # forward: after attention and after the MLP; backward: the matching two (Megatron's f/g)
    assert len(cs) == 4 * LAYERS
    act = cfg["batch"] * cfg["seq"] * cfg["d_model"] * 4
    assert all(e.inputs[0].nbytes == act for e in cs)   # each of batch·seq·d_model elements
    # forward ones are those the loss depends on: after attention's w_o and after the MLP's w_out
    eqns = low.spmd.program.eqns
    producer = {o: i for i, e in enumerate(eqns) for o in e.outputs}
    need, todo = set(), [low.spmd.program.outputs[0]]
    while todo:
        i = producer.get(todo.pop())
        if i is not None and i not in need:
            need.add(i)
            todo.extend(eqns[i].inputs)
    fwd = [e for i, e in enumerate(eqns) if i in need and e.prim == "all_reduce" and e.params["axes"] == ("model",)]
    assert len(fwd) == 2 * LAYERS, [e.source for e in cs]


def test_mp_mlp_one_allreduce_per_layer_pair(case):
    cfg, low = lowered(case, "mlp", "mp", "batch=2,model=2")
    cs = comms(low)
    assert {(e.prim, e.params["axes"]) for e in cs} == {("all_reduce", ("model",))}
    # forward: after each w_out; backward: after each w_in's input gradient, except the first
    # layer's (the input x needs no gradient, so jax never computes it)
    assert len(cs) == 2 * LAYERS - 1


@pytest.mark.slow
def test_bp_allreduces_gradients_over_batch_only(case):
    for scenario in ("mlp", "transformer"):
        _, low = lowered(case, scenario, "bp", "batch=2,model=2")
        cs = comms(low)
        assert {(e.prim, e.params["axes"]) for e in cs} == {("all_reduce", ("batch",))}
        # one per parameter gradient, plus the loss
        assert len(cs) == len(params_of(low)) + 1
        grad_bytes = sorted(e.inputs[0].nbytes for e in cs if e.inputs[0].ndim)
        assert grad_bytes == sorted(v.nbytes for _, v in params_of(low) if v.ndim)


def test_bp_over_two_data_axes(case):
    _, low = lowered(case, "transformer", "bp", "pod=2,batch=2,model=2")
    cs = comms(low)
    assert {(e.prim, e.params["axes"]) for e in cs} == {("all_reduce", ("pod", "batch"))}


@pytest.mark.slow
def test_z3_gathers_each_parameter_before_use_and_reduce_scatters_each_gradient(case):
    _, low = lowered(case, "transformer", "z3", "batch=2,model=2")
    spmd = low.spmd
    cs = comms(low)
    kinds = Counter(e.prim for e in cs)
    sharded = [(n, lv) for n, lv, sh in zip(spmd.input_names, spmd.program.inputs, spmd.in_shardings)
               if n.startswith("params/") and "batch" in sh.axes()]
    assert len(sharded) == len(params_of(low))          # every parameter is sharded
    produced_by = {o: e for e in spmd.program.eqns for o in e.outputs}

    def root(v):   # follow layout-only ops (a broadcast of a bias, a reshape) back to the input
        e = produced_by.get(v)
        while e is not None and e.prim in ("broadcast_in_dim", "reshape", "transpose", "convert_element_type"):
            v = e.inputs[0]
            e = produced_by.get(v)
        return v

    gathered_inputs = Counter(root(e.inputs[0]) for e in cs if e.prim == "all_gather")
    for n, lv in sharded:
        # gathered before use (its forward users only see the gathered copy)
        assert gathered_inputs[lv] >= 1, n
        users = [e for e in spmd.program.eqns if lv in e.inputs]
        assert all(e.prim in ("all_gather", "broadcast_in_dim", "sub", "mul", "add") for e in users), \
            (n, [e.prim for e in users])
    matrices = [lv for n, lv in sharded if lv.ndim == 2 and "embed" not in n]
    assert all(gathered_inputs[lv] == 2 for lv in matrices)   # forward use + backward use
    assert kinds["reduce_scatter"] == len(sharded)          # each gradient, once
    assert all(e.params["axes"] == ("batch",) for e in cs)
    assert kinds["all_reduce"] == 1                         # the loss
    assert kinds["all_to_all"] == 0


def test_z2_reduce_scatters_gradients_and_gathers_updated_params(case):
    _, low = lowered(case, "transformer", "z2", "batch=2,model=2")
    spmd = low.spmd
    kinds = Counter(e.prim for e in comms(low))
    n_params = len(params_of(low))
    assert kinds == Counter({"reduce_scatter": n_params, "all_gather": n_params, "all_reduce": 1})
    assert all(sh.is_replicated() for n, sh in zip(spmd.input_names, spmd.in_shardings) if n.startswith("params/"))
    assert all("batch" in sh.axes() for n, sh in zip(spmd.input_names, spmd.in_shardings)
               if n.startswith("opt/mu/") and spmd.global_in_shapes[spmd.input_names.index(n)])
    # every all_gather feeds a program output (an updated parameter), nothing else
    outs = {o for o in spmd.program.outputs if isinstance(o, Var)}
    assert all(e.outputs[0] in outs for e in comms(low) if e.prim == "all_gather")


def test_allreduce_then_slice_becomes_reduce_scatter(case):
    # Z2's gradient is partial over batch and the update wants it tiled by batch:
    # the lowering never emits all_reduce followed by all_slice on the same axes.
    _, low = lowered(case, "mlp", "z2", "batch=4,model=2")
    eqns = low.spmd.program.eqns
    produced_by = {o: e for e in eqns for o in e.outputs}
    for e in eqns:
        if e.prim == "all_slice":
            src = produced_by.get(e.inputs[0])
            assert not (src is not None and src.prim == "all_reduce"
                        and set(src.params["axes"]) & set(e.params["axes"]))


@pytest.mark.parametrize("strategy", ["bp", "mp", "bp+mp"])
def test_no_conflicts_and_no_needless_collectives(case, strategy):
    _, low = lowered(case, "transformer", strategy, "batch=2,model=2")
    assert low.states[-1].conflicts == []
    assert not [e for e in comms(low) if e.prim in ("all_gather", "all_to_all")]

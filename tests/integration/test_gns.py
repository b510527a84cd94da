"""The ``gns`` scenario (scenarios/gns/scenario.py): every strategy equals the unpartitioned jax.jit on the
in-process mesh; ``edge`` resolves the node aggregation with one reduce over the edge axes per
message-passing step and moves no edge-sized array; ``node`` all-gathers the node latents once per
step; the closed-form parameter count and model FLOPs match the traced program; the full presets
are priced by ``simulate`` and the tiny one by ``simulate-des``."""
from __future__ import annotations

import functools
import math
from collections import Counter

import jax
import numpy as np
import pytest

from partir_emu import Mesh
from partir_emu.api import lower_program, trace
from partir_emu.app.experiment import flatten, verify
from partir_emu.errors import ScenarioError
from partir_emu.hwmodels import simulate
from partir_emu.hwmodels.des import simulate_des
from partir_emu.runtime.local_mesh import LocalMesh
from scenarios.common import STATE_OUTPUTS, count_params
from scenarios.gns import model as gns_model
from scenarios.gns import scenario as gns

pytestmark = pytest.mark.xdist_group("gns")    # its cached programs and references: made once, on one worker

SC = gns.SCENARIO
REDUCES = ("all_reduce", "reduce_scatter")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "collective_permute")


@functools.cache
def _case(overrides: str | None = None):
    """(cfg, traced program, flat seed-0 inputs, jax.jit reference outputs) of the tiny preset."""
    cfg = SC.config("tiny", overrides)
    step = SC.make_step(cfg)
    inputs = SC.make_inputs(cfg, 0)
    ref = [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.jit(step)(*inputs))]
    return cfg, trace(step, *SC.abstract_inputs(cfg)), flatten(inputs), ref


@functools.cache
def _lowered(strategy: str, mesh: str, overrides: str | None = None):
    cfg, prog, _, _ = _case(overrides)
    m = Mesh.parse(mesh)
    low = lower_program(prog, m, SC.strategy(strategy, m, cfg), STATE_OUTPUTS)
    assert not low.warnings, low.warnings            # no tactic conflicts with itself
    return low.spmd


def _collectives(spmd) -> list:
    return [e for e in spmd.program.eqns if e.prim in COLLECTIVES]


CASES = [(s, "batch=4") for s in gns.STRATEGY_NAMES if s not in ("bp+edge", "bp+auto")] + [
    ("bp+edge", "batch=2,model=2"), ("bp+auto", "batch=2,model=2"), ("bp+edge", "pod=2,batch=2,model=2"), ("edge", "pod=2,batch=2"),
    ("node", "batch=2,model=2"), ("bp", "batch=2,model=2")]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, mesh", CASES)
def test_every_strategy_matches_jax(strategy, mesh):
    cfg, _, inputs, ref = _case()
    spmd = _lowered(strategy, mesh)
    res = LocalMesh(Mesh.parse(mesh), algorithm="ring").run(spmd, inputs)
    ver = verify(res.outputs, ref, spmd.output_names, rtol=1e-5, atol=1e-6)
    assert ver.verified, ver
    ins = dict(zip(spmd.input_names, spmd.in_shardings))
    for name, sh in zip(spmd.output_names, spmd.out_shardings):       # the state keeps its layout
        head, _, rest = name.partition("/")
        if head in STATE_OUTPUTS:
            assert sh == ins[f"{STATE_OUTPUTS[head]}/{rest}"], name


@pytest.mark.slow
def test_loss_decreases_and_graphs_are_connected():
    cfg = SC.config("tiny")
    params, opt, batch = SC.make_inputs(cfg, 1)
    step = jax.jit(SC.make_step(cfg))
    losses = []
    for _ in range(3):
        loss, params, opt = step(params, opt, batch)
        losses.append(float(loss))
    assert losses[0] > losses[1] > losses[2], losses
    for s, r in zip(batch["senders"], batch["receivers"]):
        assert set(s) == set(r) == set(range(cfg["nodes"]))             # every node sends and receives
    assert not np.array_equal(batch["receivers"][:, :cfg["nodes"]], np.tile(np.arange(cfg["nodes"]), (cfg["graphs"], 1)))


# -- the collectives of edge and node sharding -----------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["edge", "edge+z3"])
@pytest.mark.parametrize("mesh, axes", [("batch=4", ("batch",)), ("pod=2,batch=2", ("pod", "batch"))])
def test_edge_sharding_reduces_nodes_once_per_step(strategy, mesh, axes):
    """edges=96: a local edge block (24) differs from every other size, so an edge-sized operand is
    recognisable. Forward: one reduce of the aggregated messages per step; backward: one reduce of
    the gather's gradient per step; no activation other than those moves, nothing edge-sized at all."""
    cfg, *_ = _case("edges=96")
    spmd = _lowered(strategy, mesh, "edges=96")
    node_shape = (cfg["graphs"], cfg["nodes"], cfg["latent"])
    colls = _collectives(spmd)
    node_reduces = [e for e in colls if e.prim in REDUCES and tuple(e.inputs[0].shape) == node_shape]
    assert all(tuple(e.params["axes"]) == axes for e in node_reduces)
    forward = [e for e in node_reduces if "(forward)" in e.source and "concatenate" in e.source]
    backward = [e for e in node_reduces if "_gather" in e.source]
    assert len(forward) == len(backward) == cfg["steps"] and len(node_reduces) == 2 * cfg["steps"], \
        [e.source for e in node_reduces]
    edge_sizes = {cfg["edges"], cfg["edges"] // math.prod(Mesh.parse(mesh).axis_size(a) for a in axes)}
    assert not [e for e in colls if edge_sizes & set(e.inputs[0].shape)], "an edge-sized array moved"
    # the rest are the edge MLPs' weights: gradients all-reduced (edge) or reduce-scattered and the
    # weights all-gathered (edge+z3); never an activation [G, N|E, latent] (a LayerNorm's
    # [1, 1, latent] broadcast scale, all-gathered under edge+z3, is a parameter)
    rest = [e for e in colls if e not in node_reduces]
    assert all(e.params["axes"] == node_reduces[0].params["axes"] for e in rest)
    assert not [e for e in rest if len(e.inputs[0].shape) == 3 and e.inputs[0].shape[1] > 1], "an activation moved"
    kinds = Counter(e.prim for e in rest)
    assert set(kinds) == ({"all_reduce"} if strategy == "edge" else {"all_gather", "reduce_scatter"})


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["node", "node+z3"])
def test_node_sharding_all_gathers_the_node_table_once_per_step(strategy):
    """The only activations that move are the node latents (no edge-sized array: the edge MLPs run
    replicated); node+z3 adds its MLPs' weight gathers and gradient reduce-scatters."""
    cfg, *_ = _case()
    spmd = _lowered(strategy, "batch=4")
    colls = _collectives(spmd)
    moved = [e for e in colls if len(e.inputs[0].shape) == 3 and e.inputs[0].shape[1] > 1]
    gathers = [e for e in colls if e.prim == "all_gather" and len(e.inputs[0].shape) == 3]
    assert moved == [e for e in gathers if e.inputs[0].shape[1] > 1]
    gathers = [e for e in gathers if e.inputs[0].shape[1] > 1]
    assert [tuple(e.outputs[0].shape) for e in gathers] == [(cfg["graphs"], cfg["nodes"], cfg["latent"])] * \
        (2 * cfg["steps"])
    assert sum("_gather" in e.source for e in gathers) == cfg["steps"]          # forward: the edge gathers
    assert sum("_aggregate" in e.source for e in gathers) == cfg["steps"]       # backward: the aggregation's


def test_strategy_errors():
    cfg = SC.config("tiny")
    with pytest.raises(ScenarioError, match=r"edges=64 is not divisible.*\['batch'\]"):
        SC.strategy("edge", Mesh(batch=3), cfg)
    with pytest.raises(ScenarioError, match=r"'bp\+edge' needs mesh axis 'model'"):
        SC.strategy("bp+edge", Mesh(batch=4), cfg)
    with pytest.raises(ScenarioError, match=r"graphs=4 is not divisible.*--set graphs=.*edge"):
        SC.strategy("bp", Mesh(batch=8), cfg)
    with pytest.raises(ScenarioError, match=r"edges=20 < 2 × nodes=16"):
        SC.config("tiny", "edges=20")


# -- counts against the traced program --------------------------------------------------------------

def test_param_count_and_model_flops_match_the_traced_program():
    for preset in SC.presets:
        cfg = SC.config(preset)
        assert gns.param_count(cfg) == count_params(SC.param_shapes(cfg))
    assert gns.param_count(SC.config("full")) == 1_591_682 and gns.param_count(SC.config("xl")) == 1_592_835
    cfg, prog, inputs, _ = _case()
    params = [x for n, x in zip(SC.input_names(cfg), inputs) if n.startswith("params/")]
    assert sum(x.size for x in params) == gns.param_count(cfg)
    flops = 0
    for e in prog.eqns:
        if e.prim == "dot_general":
            (contract, _), _ = e.params["dimension_numbers"]
            flops += 2 * math.prod(e.outputs[0].shape) * math.prod(e.inputs[0].shape[d] for d in contract)
    # the step does not compute the input gradients of the encoders' first layers (data inputs)
    h, g = cfg["latent"], cfg["graphs"]
    skipped = 2 * g * h * (cfg["nodes"] * cfg["node_in"] + cfg["edges"] * cfg["edge_in"])
    assert flops == gns.model_flops(cfg) - skipped


@pytest.mark.slow
def test_model_matches_a_numpy_message_passing_step():
    """One message-passing step written with numpy loops over edges equals gns_model.forward's."""
    cfg = SC.config("tiny", "steps=1,graphs=1")
    params, _, batch = SC.make_inputs(cfg, 3)
    got = np.asarray(gns_model.forward(params, batch, 1))

    def mlp(x, p):
        n = sum(k.startswith("layer_") for k in p)
        for i in range(n):
            x = x @ p[f"layer_{i}"]["w"] + p[f"layer_{i}"]["b"]
            x = np.maximum(x, 0) if i < n - 1 else x
        if "norm" in p:
            x = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + gns_model.EPS)
            x = x * p["norm"]["scale"] + p["norm"]["bias"]
        return x

    x = mlp(batch["nodes"][0].astype(np.float64), params["encoder"]["node"])
    e = mlp(batch["edges"][0].astype(np.float64), params["encoder"]["edge"])
    s, r = batch["senders"][0], batch["receivers"][0]
    m = mlp(np.concatenate([e, x[s], x[r]], -1), params["step_0"]["edge"])
    agg = np.zeros_like(x)
    for j in range(cfg["edges"]):
        agg[r[j]] += m[j]
    x = x + mlp(np.concatenate([x, agg], -1), params["step_0"]["node"])
    np.testing.assert_allclose(got[0], mlp(x, params["decoder"]), rtol=1e-4, atol=1e-5)


# -- pricing ------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("hardware", ["tpu-v4", "h100"])
def test_full_preset_is_priced(hardware):
    cfg = SC.config("full")
    prog = trace(SC.make_step(cfg), *SC.abstract_inputs(cfg))
    m = Mesh(batch=8)
    spmd = lower_program(prog, m, SC.strategy("edge", m, cfg), STATE_OUTPUTS).spmd
    rep = simulate(spmd, hardware, model_flops=gns.model_flops(cfg) / 8)
    assert rep.step_s > 0 and 0 < rep.mfu < 1
    assert sum(e.prim in REDUCES and tuple(e.inputs[0].shape) == (2, 2048, 128) for e in spmd.collectives()) == 20


def test_tiny_is_priced_by_the_des():
    rep = simulate_des(_lowered("edge", "batch=4"), "tpu-v4")
    assert rep.step_s > 0

"""Loops partitioned without unrolling (compiler/loop_view.py, lower_loops.py): the body is
partitioned once, the carry's tiling is a fixed point, stacked per-layer weights give their
per-iteration tiling to the body, and the SpmdProgram keeps one loop equation.

References: ``jax.jit`` of the same function, and the same model written with its layers
unrolled (``layers_as=unrolled``), which has no loop at all."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partir_emu as pe
from partir_emu.compiler.api import partition_and_lower
from partir_emu.core.loops import static_eqn_count, walk
from partir_emu.runtime.local_mesh import LocalMesh
from scenarios.common import get_scenario

pytestmark = pytest.mark.xdist_group("loop_partition")    # its cached programs and references: made once, on one worker

SC = get_scenario("transformer")
MESH = pe.Mesh(batch=2, model=2)
STATE = {"1": "params", "2": "opt"}
STRATEGIES = ("bp", "mp", "z3", "bp+mp", "bp+mp+z3")


def _loops(program):
    return [e for e, _ in walk(program) if e.prim == "loop"]


@functools.cache
def _case(layers_as: str, layers: int = 2, **extra):
    cfg = SC.complete_config(dict(SC.presets["tiny"], layers=layers, layers_as=layers_as, **extra))
    rng = np.random.default_rng(0)
    params, batch = SC.make_params(cfg, rng), SC.make_batch(cfg, rng)
    zeros = jax.tree.map(np.zeros_like, params)
    args = (params, {"mu": zeros, "nu": zeros, "count": np.zeros((), np.int32)}, batch)
    step = SC.make_step(cfg)
    return cfg, step, args, pe.trace(step, *args)


def _lower(layers_as: str, strategy: str, layers: int = 2, **extra):
    cfg, step, args, prog = _case(layers_as, layers, **extra)
    return partition_and_lower(prog, MESH, SC.strategies[strategy](MESH, cfg), state_outputs=STATE), args, step


def _unstack(tree: dict, layers: int) -> dict:
    """A loop model's parameter tree in the unrolled model's layout."""
    out = {k: v for k, v in tree.items() if k != "layers"}
    for i in range(layers):
        out[f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], tree["layers"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_scan_transformer_equals_jax_and_the_unrolled_model(strategy):
    low, args, step = _lower("loop", strategy)
    assert len([e for e in low.spmd.program.eqns if e.prim == "loop"]) == 2     # forward and backward
    ours = LocalMesh(MESH).run(low.spmd, jax.tree.leaves(args)).outputs
    ref = jax.tree.leaves(jax.jit(step)(*args))
    for o, r in zip(ours, ref):
        np.testing.assert_allclose(o, np.asarray(r), rtol=2e-5, atol=2e-6)
    # the same step written with its layers unrolled, partitioned by the same strategy
    ulow, uargs, _ = _lower("unrolled", strategy)
    unrolled = LocalMesh(MESH).run(ulow.spmd, jax.tree.leaves(uargs)).outputs
    struct = jax.tree.structure(jax.jit(step).eval_shape(*args))
    loss, new_params, new_opt = jax.tree.unflatten(struct, ours)
    uloss, unew_params, _ = jax.tree.unflatten(jax.tree.structure(jax.eval_shape(_case("unrolled")[1], *uargs)),
                                               unrolled)
    np.testing.assert_allclose(loss, uloss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(_unstack(new_params, 2)), jax.tree.leaves(unew_params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert new_opt["count"] == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_step_runs_the_collectives_of_the_unrolled_model(strategy):
    """Per step, the loop program executes exactly the collectives (kind, axes, bytes) of the
    unrolled model, only written once per body."""
    loop, _, _ = _lower("loop", strategy, layers=3)
    unrolled, _, _ = _lower("unrolled", strategy, layers=3)
    assert loop.spmd.stats().to_json() == unrolled.spmd.stats().to_json()


@pytest.mark.slow
def test_48_layers_lower_to_a_program_at_least_20x_smaller():
    loop, _, _ = _lower("loop", "bp+mp+z3", layers=48)
    unrolled, _, _ = _lower("unrolled", "bp+mp+z3", layers=48)
    n_loop, n_unrolled = static_eqn_count(loop.spmd.program), static_eqn_count(unrolled.spmd.program)
    assert n_unrolled >= 20 * n_loop, (n_loop, n_unrolled)
    assert [e.params["length"] for e in _loops(loop.spmd.program)] == [48, 48]


def test_megatron_body_all_reduces_twice_per_layer_and_pass():
    """Megatron's textbook count, per layer: one all_reduce after attention and one after the MLP
    in the forward pass, the same two in the backward pass; all in the bodies, over ``model``."""
    low, _, _ = _lower("loop", "mp")
    fwd, bwd = _loops(low.spmd.program)
    for body in (fwd.params["body"], bwd.params["body"]):
        ars = [e for e in body.eqns if e.prim == "all_reduce"]
        assert [e.params["axes"] for e in ars] == [("model",), ("model",)]
        assert not any(e.prim in ("all_gather", "all_to_all") for e in body.eqns)


def test_zero3_bf16_gathers_each_layer_param_once_per_pass_in_bf16():
    low, args, step = _lower("loop", "z3", precision="bf16", remat=1)
    fwd, bwd = _loops(low.spmd.program)
    n_leaves = len(jax.tree.leaves(args[0]["layers"]))
    for k, body in enumerate((fwd.params["body"], bwd.params["body"])):
        gathers = [e for e in body.eqns if e.prim == "all_gather"]
        roots = {_root(body, e.inputs[0]) for e in gathers}
        assert roots <= set(body.inputs) and len(roots) == len(gathers)      # each parameter at most once
        if k == 0:      # the forward pass reads every parameter (the backward pass not the output bias)
            assert len(gathers) == n_leaves, [str(e) for e in gathers]
        matrices = [e for e in gathers if e.outputs[0].ndim == 2]
        assert matrices and all(e.outputs[0].dtype == "bfloat16" for e in matrices)
    # stacked weights enter the loops still sharded (no gather of all layers before a loop)
    prog = low.spmd.program
    stacked = {v for v, n in zip(prog.inputs, prog.input_names) if n.startswith("params/layers/")}
    assert len(stacked) == n_leaves
    assert not [e for e in prog.eqns if e.prim == "all_gather" and _root(prog, e.inputs[0]) in stacked]


def _root(body, v):
    """The body input a chain of single-operand local ops (cast, reshape, ...) starts from."""
    producer = {o: e for e in body.eqns for o in e.outputs}
    while v in producer and len(producer[v].inputs) == 1:
        v = producer[v].inputs[0]
    return v


def _mesh_run(fn, args, schedule, mesh=MESH):
    low = pe.jit(fn, mesh=mesh, schedule=schedule).lower(*args)
    out = LocalMesh(mesh).run(low.spmd, jax.tree.leaves(args)).outputs
    for o, r in zip(out, jax.tree.leaves(jax.jit(fn)(*args))):
        r = np.asarray(r)
        np.testing.assert_allclose(o, r, rtol=2e-5, atol=2e-6 * max(1.0, float(np.abs(r).max())))
    return low


RNG = np.random.default_rng(1)
WS = (0.3 * RNG.standard_normal((5, 8, 8))).astype(np.float32)
XB = RNG.standard_normal((4, 8)).astype(np.float32)


def _resnet(ws, x):
    def body(h, w):
        return h + jnp.tanh(h @ w), jnp.sum(h)
    h, ys = jax.lax.scan(body, x, ws)
    return jnp.sum(h * h) + jnp.sum(ys)


def test_a_batch_tiled_carry_is_a_fixed_point_without_collectives_in_the_body():
    low = _mesh_run(jax.grad(_resnet, argnums=(0, 1)), (WS, XB), [pe.ManualPartition({"x": 0}, axis="batch")])
    for loop in _loops(low.spmd.program):
        body = loop.params["body"]
        nk = loop.params["num_carry"]
        assert not any(e.prim in ("all_gather", "all_to_all", "all_slice") for e in body.eqns), body.pretty()
        # the carry keeps its batch tiling from one iteration to the next: local shape [2, 8]
        assert [v.shape for v in body.inputs[loop.params["num_consts"]:][:nk]] == [(2, 8)]
    assert not low.final_state.conflicts


def test_a_carry_the_body_retiles_is_resharded_at_the_end_of_the_body():
    """``h @ w`` with ``w`` tiled on its output dim makes the new carry tiled on ``model`` while the
    carry came in replicated: the body ends with the all_gather that restores the carry's layout."""
    low = _mesh_run(jax.grad(lambda ws, x: _resnet(ws, x), argnums=(0, 1)), (WS, XB),
                    [pe.ManualPartition({"ws": 2}, axis="model")])
    fwd = _loops(low.spmd.program)[0]
    body = fwd.params["body"]
    last_carry = body.outputs[0]
    producer = {o: e for e in body.eqns for o in e.outputs}
    assert producer[last_carry].prim in ("all_gather", "add")
    assert any(e.prim == "all_gather" and e.params["axes"] == ("model",) for e in body.eqns)


def test_nested_loops_and_fori_loop():
    def f(ws, x):
        def outer(h, w):
            h = jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w) + 0.1 * i, h)
            return h, None
        h, _ = jax.lax.scan(outer, x, ws)
        return jnp.sum(h)
    low = _mesh_run(jax.grad(f), (WS, XB), [pe.ManualPartition({"x": 0}, axis="batch")])
    top = [e for e in low.spmd.program.eqns if e.prim == "loop"]
    inner = [e.params["length"] for t in top for e in _loops(t.params["body"])]
    # the forward and the backward scan (jax may hoist a loop-invariant part of the inner loop out)
    assert [e.params["length"] for e in top].count(5) == 2
    assert inner and set(inner) == {3}                  # the fori_loops, inside their bodies only
    assert static_eqn_count(low.spmd.program) < 120


def test_reverse_scan_and_consts():
    def f(ws, x, scale):
        def body(h, w):
            return jnp.tanh(h @ w) * scale, h[0]
        h, ys = jax.lax.scan(body, x, ws, reverse=True)
        return jnp.sum(h) + jnp.sum(ys * jnp.arange(1.0, 6.0)[:, None])
    _mesh_run(jax.grad(f, argnums=(0, 1, 2)), (WS, XB, np.float32(0.7) * np.ones(8, np.float32)),
              [pe.ManualPartition({"x": 0}, axis="batch"), pe.ManualPartition({"scale": 0}, axis="model")])


def test_tiling_the_iteration_dim_warns_and_gathers_before_the_loop():
    low = _mesh_run(_resnet, (WS[:4], XB), [pe.ManualPartition({"ws": 0}, axis="model")])
    (line,) = low.warnings
    assert "iteration dim" in line and "'ws' dim 0" in line and "tile another dim" in line
    gathers = [e for e in low.spmd.program.eqns if e.prim == "all_gather"]
    assert [e.outputs[0].shape for e in gathers] == [(4, 8, 8)]

"""Vocab-parallel embeddings (the ``emb`` strategies): a masked local lookup into a vocab-tiled
table (compiler/lowering/indexed.py), its scatter-add gradient applied per block, and a softmax
cross-entropy over vocab-tiled logits whose max is a pending max (an all_reduce(max) of
[batch, seq]), so no collective carries [batch, seq, vocab] or the whole [vocab, d_model] table.
Reference: ``jax.jit`` of the same function."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partir_emu as pe
from partir_emu.compiler.api import partition_and_lower
from partir_emu.errors import ScenarioError
from partir_emu.runtime.local_mesh import LocalMesh
from scenarios.common import STATE_OUTPUTS, get_scenario

V, D, B, S = 40, 8, 4, 6
RNG = np.random.default_rng(0)
TABLE = RNG.standard_normal((V, D)).astype(np.float32)
OUT = RNG.standard_normal((D, V)).astype(np.float32)
TOK = RNG.integers(0, V, (B, S)).astype(np.int32)
TOK[0, :4] = [0, V - 1, V // 4, V // 4 - 1]           # the first and last rows and a block border
TGT = RNG.integers(0, V, (B, S)).astype(np.int32)


def _run(fn, args, mesh, schedule, tol=2e-6):
    low = pe.jit(fn, mesh=mesh, schedule=schedule).lower(*args)
    ours = LocalMesh(mesh).run(low.spmd, jax.tree.leaves(args)).outputs
    for o, r in zip(ours, jax.tree.leaves(jax.jit(fn)(*args))):
        r = np.asarray(r)
        np.testing.assert_allclose(o, r, rtol=tol, atol=tol * max(1.0, float(np.abs(r).max())))
    return low


def _ops(low, prim):
    return [e for e in low.spmd.program.eqns if e.prim == prim]


def test_a_lookup_into_a_vocab_tiled_table_is_masked_and_all_reduced():
    low = _run(lambda t, tok: jnp.tanh(t[tok]), (TABLE, TOK), pe.Mesh(model=4),
               [pe.ManualPartition({"t": 0}, axis="model")])
    (g,) = _ops(low, "gather")
    assert g.inputs[0].shape == (V // 4, D) and g.params["mode"] == "FILL_OR_DROP" and g.params["fill_value"] == 0
    assert _ops(low, "axis_index")
    # the looked-up rows [B, S, D] are summed over the model axis; the table is never gathered
    assert [(e.prim, e.inputs[0].shape) for e in low.spmd.collectives()] == [("all_reduce", (B, S, D))]


@pytest.mark.parametrize("mode", ["clip", "promise_in_bounds"])
def test_out_of_range_indices_are_clamped_once_globally(mode):
    tok = TOK.copy()
    tok[1, :3] = [-3, V, V + 17]                     # clamped to rows 0 and V-1 as XLA does

    def f(t, i):
        return jnp.take(t, i, axis=0, mode=mode) if mode == "clip" else t.at[i].get(mode=mode)
    if mode == "promise_in_bounds":
        tok = np.clip(tok, 0, V - 1)               # out of range is undefined there: stay in range
    _run(f, (TABLE, tok), pe.Mesh(model=4), [pe.ManualPartition({"t": 0}, axis="model")])


def test_a_fill_or_drop_gather_keeps_the_table_whole():
    """With mode='fill' an out-of-range row is NaN, not a sum of zeros: the dim stays blocked."""
    low = _run(lambda t, i: jnp.take(t, i, axis=0, mode="fill", fill_value=0.0), (TABLE, TOK), pe.Mesh(model=4),
               [pe.ManualPartition({"t": 0}, axis="model")])
    assert [e.prim for e in low.spmd.collectives()] == ["all_gather"]


def test_the_embedding_gradient_scatters_into_each_block():
    def loss(t, tok):
        return jnp.sum(jnp.tanh(t[tok]) ** 2)

    def step(t, tok):                                 # the new table keeps the table's layout
        return t - 0.1 * jax.grad(loss)(t, tok)
    low = _run(step, (TABLE, TOK), pe.Mesh(model=4), [pe.ManualPartition({"t": 0}, axis="model")])
    (sc,) = _ops(low, "scatter-add")
    assert sc.inputs[0].shape == (V // 4, D) and sc.params["mode"] == "FILL_OR_DROP"
    assert all(e.inputs[0].shape == (B, S, D) for e in low.spmd.collectives())


def test_softmax_over_vocab_tiled_logits_is_a_pending_max():
    def ce(h, w, y):
        logp = jax.nn.log_softmax(h @ w, axis=-1)
        return -jnp.mean(jnp.sum(jax.nn.one_hot(y, V) * logp, -1))
    h = RNG.standard_normal((B, S, D)).astype(np.float32)
    low = _run(jax.value_and_grad(ce, argnums=(0, 1)), (h, OUT, TGT), pe.Mesh(model=4),
               [pe.ManualPartition({"w": 1}, axis="model")])
    maxes = [e for e in low.spmd.collectives() if e.params.get("op") == "max"]
    assert [e.inputs[0].shape for e in maxes] == [(B, S)]
    assert not any(V in (*e.inputs[0].shape, *e.outputs[0].shape) or V // 4 in e.inputs[0].shape
                   for e in low.spmd.collectives())


SC = get_scenario("transformer")
MESH = pe.Mesh(batch=2, model=2)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, {"tied": 1}, {"layers_as": "loop", "precision": "bf16"}])
@pytest.mark.parametrize("strategy", ["bp+emb", "bp+mp+emb", "bp+mp+emb+z3"])
def test_transformer_emb_strategies_verify_and_move_no_vocab_sized_value(strategy, extra):
    # vocab 96: no other dim of the tiny model is 96 or 48, so a vocab-sized collective is recognisable
    cfg = SC.complete_config(dict(SC.presets["tiny"], vocab=96, **extra))
    rng = np.random.default_rng(0)
    params, batch = SC.make_params(cfg, rng), SC.make_batch(cfg, rng)
    zeros = jax.tree.map(np.zeros_like, params)
    args = (params, {"mu": zeros, "nu": zeros, "count": np.zeros((), np.int32)}, batch)
    step = SC.make_step(cfg)
    low = partition_and_lower(pe.trace(step, *args), MESH, SC.strategies[strategy](MESH, cfg), state_outputs=STATE_OUTPUTS)
    ours = LocalMesh(MESH).run(low.spmd, jax.tree.leaves(args)).outputs
    ref = jax.tree.leaves(jax.jit(step)(*args))
    tol = 2e-2 if extra.get("precision") == "bf16" else 2e-5
    np.testing.assert_allclose(ours[0], np.asarray(ref[0]), rtol=tol)          # the loss
    for o, r in zip(ours, ref):
        r = np.asarray(r, np.float32)
        np.testing.assert_allclose(np.asarray(o, np.float32), r, rtol=tol, atol=tol * max(1.0, float(np.abs(r).max())))
    for e in low.spmd.collectives():
        shapes = (e.inputs[0].shape, e.outputs[0].shape)
        # never the whole vocab: no [B, S, V] logits and no [V, D] table in any collective
        assert not any(96 in s for s in shapes), str(e)
        # over the model axis nothing vocab-sized at all (the data axis reduces table *shards*)
        if "model" in e.params["axes"]:
            assert not any(48 in s for s in shapes), str(e)


def test_emb_needs_an_embedding_and_a_divisible_vocabulary():
    mlp = get_scenario("mlp")
    assert "bp+emb" not in mlp.strategies
    cfg = SC.complete_config(dict(SC.presets["tiny"], vocab=33))
    with pytest.raises(ScenarioError, match="dim 0 of params/embed/tokens.*not divisible by axis 'model'"):
        SC.strategies["bp+emb"](MESH, cfg)

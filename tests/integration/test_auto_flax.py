"""AutomaticPartition on a Flax linen decoder LM nobody here wrote (the blocks of
tests/integration/test_third_party_models.py: causal self-attention, dropout, LayerNorm, ``nn.remat``; optax
clipping + AdamW), as a user would call it: ``bp + AutomaticPartition("model")``.

- At a size where model parallelism pays (d_model 512, seq 256; traced abstractly, priced on
  tpu-v4), the search shards on ``model`` and its step is no dearer than the best manual
  schedule (bp; Megatron with and without the optimizer state), and strictly cheaper than
  Megatron: it keeps Megatron's MLP, shards the embedding on vocab and leaves attention
  replicated, which the analytical model prices lower at this size.
- At the tiny size of the third-party tests, a memory limit below bp's peak forces sharding on
  ``model``; the chosen step matches ``jax.jit``.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

pytestmark = pytest.mark.xdist_group("auto_flax")    # its cached programs and references: made once, on one worker

jax = pytest.importorskip("jax")
nn = pytest.importorskip("flax.linen")
optax = pytest.importorskip("optax")

import partir_emu as pe  # noqa: E402
from partir_emu.api import analytical_cost, lower_program  # noqa: E402
from tests.integration.test_third_party_models import _FLAX_MP, _Block, _check, _flax_case  # noqa: E402

TOL = 1e-9
VOCAB, D, HEADS, SEQ, BATCH, LAYERS = 2048, 512, 8, 256, 16, 2


class _BigLM(nn.Module):
    @nn.compact
    def __call__(self, tokens, train: bool = True):
        x = nn.Embed(VOCAB, D)(tokens)
        for _ in range(LAYERS):
            x = nn.remat(_Block, static_argnums=(2,))(D, HEADS)(x, train)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


@functools.cache
def _big_program():
    """The training step of :class:`_BigLM`, traced on abstract arguments (nothing allocated)."""
    model = _BigLM()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    zeros = np.zeros((BATCH, SEQ), np.int32)
    params = jax.eval_shape(lambda: model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, zeros))
    opt = jax.eval_shape(tx.init, params)

    def loss_fn(p, tokens, rng):
        logits = model.apply(p, tokens, rngs={"dropout": jax.random.wrap_key_data(rng)})
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    def step(params, opt, tokens, rng):
        loss, g = jax.value_and_grad(loss_fn)(params, tokens, rng)
        upd, opt = tx.update(g, opt, params)
        return loss, optax.apply_updates(params, upd), opt

    return pe.trace(step, params, opt, jax.ShapeDtypeStruct((BATCH, SEQ), np.int32),
                    jax.ShapeDtypeStruct((2,), np.uint32))


def _price(low):
    return analytical_cost(pe.AutomaticPartition("model"))(low.spmd)


BP = pe.ManualPartition({"tokens": 0}, axis="batch", name="bp")
MESH = pe.Mesh(batch=2, model=2)
MANUAL = {
    "bp": [BP],
    "bp+mp": [BP, pe.ManualPartition(_FLAX_MP, axis="model")],
    # Megatron with AdamW's mu/nu sharded alike (optax names them opt/<i>/<j>/mu/params/...)
    "bp+mp+opt": [BP, pe.ManualPartition({**_FLAX_MP, **{"opt/*" + k[len("params"):]: d for k, d in _FLAX_MP.items()}},
                                         axis="model")],
}


@functools.cache
def _results():
    prog = _big_program()
    manual = {name: _price(lower_program(prog, MESH, sched)).value for name, sched in MANUAL.items()}
    low = lower_program(prog, MESH, [BP, pe.AutomaticPartition("model")])
    return manual, low


@pytest.mark.slow
def test_bp_auto_on_a_flax_lm_shards_model_and_is_no_worse_than_any_manual_schedule():
    manual, low = _results()
    ((label, res),) = low.final_state.auto_results
    p = _price(low)
    assert res.decisions and p.counts.get("all_reduce over model", 0) > 0
    assert any("model" in str(s) for s in low.spmd.in_shardings)
    assert p.value <= min(manual.values()) * (1 + TOL), (res.report(label), manual)
    assert res.cost == pytest.approx(p.value, rel=1e-12)


@pytest.mark.slow
def test_bp_auto_on_a_flax_lm_is_strictly_cheaper_than_megatron():
    manual, low = _results()
    ((label, res),) = low.final_state.auto_results
    assert _price(low).value < min(manual["bp+mp"], manual["bp+mp+opt"]) * (1 - TOL), (res.report(label), manual)


@pytest.mark.slow
def test_tiny_flax_lm_under_a_memory_limit_shards_model_and_matches_jax():
    args, _, step = _flax_case()
    prog = pe.trace(step, *args)
    peak = _price(lower_program(prog, MESH, [BP])).peak_bytes
    schedule = [BP, pe.AutomaticPartition("model", memory_limit=peak - 1, budget=24)]
    spmd = _check(step, args, MESH, schedule, 1e-3)
    low = pe.jit(step, mesh=MESH, schedule=schedule).lower(*args)
    ((_, res),) = low.final_state.auto_results
    assert res.fits and res.decisions and _price(low).peak_bytes < peak
    assert any(e.params.get("axes") and "model" in e.params["axes"] for e in spmd.collectives())

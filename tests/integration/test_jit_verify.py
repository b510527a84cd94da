"""``pe.jit(...).verify(*args)``: the verdict on a user's own step (issue 25 item 4).

The step is an optax AdamW update of a two-layer MLP, written as a user would (not one of our
scenarios). Its partitioned run is judged against ``jax.jit`` and float64 by the same verdict the
scenarios get; a run whose output is corrupted in one element must be judged NO."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import partir_emu as pe
from partir_emu import api


def _step_and_args():
    opt = optax.adamw(1e-3)

    def loss(params, x, y):
        h = jax.nn.gelu(x @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["w2"] - y) ** 2)

    def step(params, state, x, y):
        val, grads = jax.value_and_grad(loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return val, optax.apply_updates(params, updates), state

    rng = np.random.default_rng(0)
    params = {"w1": rng.standard_normal((16, 32), np.float32) * 0.2, "b1": np.zeros(32, np.float32),
              "w2": rng.standard_normal((32, 8), np.float32) * 0.2}
    x, y = rng.standard_normal((16, 16), np.float32), rng.standard_normal((16, 8), np.float32)
    return step, (params, opt.init(params), x, y)


def _jitted(step):
    return pe.jit(step, mesh=pe.Mesh(batch=4), schedule=[pe.ManualPartition({"x": 0, "y": 0}, axis="batch")])


def test_verify_judges_a_users_step_against_jax_jit_and_float64():
    step, args = _step_and_args()
    jitted = _jitted(step)
    verdict = jitted.verify(*args)
    assert verdict.verified, verdict.summary()
    assert verdict.summary().startswith("verified: yes")
    # every output of the step is judged, by the program's own output names
    assert len(verdict.outputs) == len(jax.tree.leaves(jax.eval_shape(step, *args)))
    # it is the batch-partitioned program: the gradients were summed over the batch axis
    assert any(e.prim == "all_reduce" for e in jitted.lower(*args).spmd.collectives())


def test_verify_says_no_for_a_run_with_a_wrong_element(monkeypatch):
    step, args = _step_and_args()
    jitted = _jitted(step)
    run = api.Jitted.__call__

    def corrupted(self, *a):
        val, params, state = run(self, *a)
        w2 = np.array(params["w2"])
        w2[3, 1] += 1e-2          # far beyond any summation order's rounding
        return val, {**params, "w2": w2}, state

    monkeypatch.setattr(api.Jitted, "__call__", corrupted)
    verdict = jitted.verify(*args)
    assert not verdict.verified
    assert verdict.summary().startswith("verified: NO")
    assert "w2" in verdict.worst.name, verdict.worst.name


def test_verify_keeps_a_typed_prng_key_a_key():
    def f(x, key):
        return x * jax.random.normal(key, x.shape)

    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    jitted = pe.jit(f, mesh=pe.Mesh(batch=2), schedule=[pe.ManualPartition({"x": 0}, axis="batch")])
    verdict = jitted.verify(x, jax.random.key(0))
    assert verdict.verified, verdict.summary()


@pytest.mark.parametrize("bad", ["wrong arity"])
def test_verify_refuses_wrong_arguments_as_a_call_does(bad):
    step, args = _step_and_args()
    with pytest.raises(pe.PartirError, match="takes 4 argument"):
        _jitted(step).verify(*args[:3])


def test_verify_names_a_float64_reference_that_computed_in_float32():
    """A step that casts to float32 inside (as HF transformers' Flax modules do with their default
    ``dtype``) computes in float32 under x64 too: the verdict says so instead of calling that run
    a float64 reference."""
    def narrowing(w, x):
        return jnp.tanh(x.astype(jnp.float32) @ w.astype(jnp.float32)).sum(0)

    rng = np.random.default_rng(1)
    w, x = rng.standard_normal((16, 8), np.float32), rng.standard_normal((8, 16), np.float32)
    jitted = pe.jit(narrowing, mesh=pe.Mesh(batch=2), schedule=[pe.ManualPartition({"x": 0}, axis="batch")])
    verdict = jitted.verify(w, x)
    assert verdict.reference.startswith("float32 in "), verdict.reference
    assert "reference computed in float32" in verdict.summary()
    step, args = _step_and_args()
    assert _jitted(step).verify(*args).reference == "float64"


def test_verify_widens_int32_indices_that_the_step_slices_with_beside_python_ints():
    """HF's Flax KV-cache decode (Llama's) keeps its cache index int32 and slices with it beside
    Python int literals, which jax's 64-bit mode makes int64: ``lax.dynamic_slice`` refuses the mix,
    so the step fails under x64 on its own arguments. The float64 reference widens its signed
    integer arguments too (before, verify raised a TraceError and gave no verdict)."""
    def decode(cache, index):
        window = jax.lax.dynamic_slice(cache, (0, index, 0), (cache.shape[0], 2, cache.shape[2]))
        return jnp.tanh(window).sum(1), index + 1

    cache, index = np.random.default_rng(2).standard_normal((4, 8, 3)).astype(np.float32), np.int32(3)
    with jax.enable_x64(True), pytest.raises(TypeError, match="dynamic_slice"):
        jax.jit(decode)(cache.astype(np.float64), index)
    jitted = pe.jit(decode, mesh=pe.Mesh(batch=2), schedule=[pe.ManualPartition({"cache": 0}, axis="batch")])
    verdict = jitted.verify(cache, index)
    assert verdict.verified and verdict.reference == "float64", verdict.summary()

"""What other model libraries' steps needed (issue 25: "we hold other libraries and models back"),
each as the pure-jax pattern the library emits, so these tests need no library:

- **Equinox's ``BatchNorm(axis_name=...)``** under ``jax.vmap(..., axis_name=...)``: vmap writes the
  ``lax.pmean`` over the named batch as ``psum[axes=(0,)]`` (and its transpose as ``psum[axes=()]``),
  which the tracer refused. A reduction over positional dims now (``pmax``/``pmin`` alike).
- **Equinox's state** keeps weakly typed int32 scalars and checks that a new value has the old one's
  dtype: verify's float64 reference (jax's 64-bit mode) made new ones weak int64. A weak scalar
  argument is widened as jax makes it under x64 now.
- **flax.nnx's rng state** (``nnx.Dropout(rngs=...)``) is a typed PRNG key in the step's outputs:
  verify failed converting it to numpy, and a call returned its key data. A key comes back a key.
- **A step that fails in float64** (``nnx.Embed`` fixes float32 at construction; in an
  ``nnx.scan`` the carry then changes dtype under x64): verify says so and what to do, not jax's
  own error alone.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partir_emu as pe
from partir_emu.errors import TraceError

BP = pe.ManualPartition({"x": 0}, axis="batch")


def _batch_norm_step():
    """Per-example code normalising over its vmapped batch by name, as eqx.nn.BatchNorm does."""
    def per_example(w, x):
        h = x @ w
        mean = jax.lax.pmean(h, "batch")
        var = jax.lax.pmean((h - mean) ** 2, "batch")
        return jnp.tanh((h - mean) * jax.lax.rsqrt(var + 1e-5)), jax.lax.pmax(jax.lax.stop_gradient(h), "batch")

    def step(w, x):
        def loss(w):
            y, peak = jax.vmap(per_example, in_axes=(None, 0), out_axes=(0, None), axis_name="batch")(w, x)
            return (y ** 2).sum() + peak.sum()
        return jax.value_and_grad(loss)(w)

    rng = np.random.default_rng(0)
    return step, (rng.standard_normal((6, 4), np.float32), rng.standard_normal((8, 6), np.float32))


def test_a_pmean_over_a_vmapped_batch_is_a_reduction_and_verifies_batch_parallel():
    step, args = _batch_norm_step()
    prims = {e.prim for e in pe.trace(step, *args).eqns}
    assert {"reduce_sum", "reduce_max"} <= prims and not prims & {"psum", "pmax"}, prims
    jitted = pe.jit(step, mesh=pe.Mesh(batch=4), schedule=[BP])
    # the batch statistics are sums over the tiled batch: all-reduced over it
    assert any(e.prim == "all_reduce" for e in jitted.lower(*args).spmd.collectives())
    verdict = jitted.verify(*args)
    assert verdict.verified, verdict.summary()



def _mlp_loss(w, x):
    return jax.value_and_grad(lambda w: jnp.tanh(x @ w).sum())(w)


def _jitted(step):
    return pe.jit(step, mesh=pe.Mesh(batch=4), schedule=[BP])


def _w_x():
    rng = np.random.default_rng(0)
    return rng.standard_normal((6, 4), np.float32), rng.standard_normal((8, 6), np.float32)


def test_a_weakly_typed_scalar_in_the_state_verifies():
    def step(w, count, x):
        new = count * 0 + jnp.asarray(1)          # a scalar the step makes: weak, of jax's default int
        if (new.dtype, new.weak_type) != (count.dtype, count.weak_type):    # as eqx.nn.State.set checks
            raise ValueError(f"the state's count changed type: {count.aval} -> {new.aval}")
        loss, g = _mlp_loss(w, x)
        return loss, w - 0.1 * g, count + new
    w, x = _w_x()
    verdict = _jitted(step).verify(w, jnp.asarray(0), x)
    assert verdict.verified, verdict.summary()


def test_a_typed_key_in_the_outputs_comes_back_a_key_and_verifies():
    def step(w, key, x):
        key, sub = jax.random.split(key)
        keep = jax.random.bernoulli(sub, 0.75, x.shape)
        loss, g = _mlp_loss(w, jnp.where(keep, x / 0.75, 0))
        return loss, w - 0.1 * g, key
    w, x = _w_x()
    args = (w, jax.random.key(1), x)
    jitted = _jitted(step)
    _, _, key = jitted(*args)
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key), key
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(jax.jit(step)(*args)[2]))
    verdict = jitted.verify(*args)
    assert verdict.verified, verdict.summary()


def test_a_step_that_fails_in_float64_is_named_with_what_to_do():
    def step(w, x):
        # a float32 the step fixed (a module's dtype) carried against a float64 weight under x64
        h, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x.astype(jnp.float32), None, length=2)
        return h.sum()
    w = np.eye(6, dtype=np.float32)
    _, x = _w_x()
    with pytest.raises(TraceError, match="64-bit mode.*carry.*dtype=jnp.float64"):
        _jitted(step).verify(w, x)

"""What other model libraries' steps needed (issue 25: "we hold other libraries and models back"),
each as the pure-jax pattern the library emits, so these tests need no library:

- **Equinox's ``BatchNorm(axis_name=...)``** under ``jax.vmap(..., axis_name=...)``: vmap writes the
  ``lax.pmean`` over the named batch as ``psum[axes=(0,)]`` (and its transpose as ``psum[axes=()]``),
  which the tracer refused. A reduction over positional dims now (``pmax``/``pmin`` alike).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import partir_emu as pe

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


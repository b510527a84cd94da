"""``scan``, ``fori_loop`` and ``cond`` trace (compiler/tracing/loops.py: scan as one loop equation,
its body traced once; cond as a select over every branch), partition and match ``jax.jit``,
forward and gradient; a ``while`` with a run-time trip count is still refused, with advice."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partir_emu as pe
from partir_emu.core.loops import unroll
from partir_emu.errors import UnsupportedPrimitiveError

RNG = np.random.default_rng(0)
W = (0.3 * RNG.standard_normal((4, 8, 8))).astype(np.float32)
X = RNG.standard_normal((6, 8)).astype(np.float32)
MESH = pe.Mesh(batch=2, model=2)
SCHEDULE = [pe.ManualPartition({"x": 0}, axis="batch"), pe.ManualPartition({"w": 2}, axis="model")]


def _scan_loss(w, x, reverse=False):
    def body(c, wl):
        c = jnp.tanh(c @ wl)
        return c, jnp.sum(c * c)
    c, ys = jax.lax.scan(body, x, w, reverse=reverse)
    return jnp.sum(c) + jnp.sum(ys * jnp.arange(1, ys.shape[0] + 1, dtype=ys.dtype))


def _check(fn, *args, tol=2e-5):
    ours = jax.tree.leaves(pe.jit(fn, mesh=MESH, schedule=SCHEDULE)(*args))
    ref = jax.tree.leaves(jax.jit(fn)(*args))
    for o, r in zip(ours, ref):
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=tol, atol=tol)


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_forward_and_gradient(reverse):
    def f(w, x):
        return _scan_loss(w, x, reverse)
    _check(f, W, X)
    _check(jax.grad(f), W, X)


def test_scan_is_one_loop_whose_body_is_traced_once():
    one = pe.trace(lambda w, x: _scan_loss(w, x), W[:1], X)
    four = pe.trace(lambda w, x: _scan_loss(w, x), W, X)
    for p, n in ((one, 1), (four, 4)):
        (loop,) = [e for e in p.eqns if e.prim == "loop"]
        assert loop.params["length"] == n
        assert sum(e.prim == "dot_general" for e in loop.params["body"].eqns) == 1
        assert not any(e.prim == "dot_general" for e in p.eqns)          # the matmul is in the body only
    assert len(one.eqns) == len(four.eqns)                                 # the program does not grow
    # unrolled (the reference semantics) it has one matmul per iteration
    assert sum(e.prim == "dot_general" for e in unroll(four).eqns) == 4


def test_fori_loop_with_static_bounds():
    def f(w, x):
        return jnp.sum(jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w[i]), x))
    _check(f, W, X)
    _check(jax.grad(f), W, X)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cond_on_a_traced_predicate_picks_the_right_branch(sign):
    def f(w, x):
        s = jnp.sum(x) * sign
        return jax.lax.cond(s > 0, lambda v: jnp.sum(jnp.tanh(v @ w[0])), lambda v: -jnp.sum(v * v), x)
    x = np.abs(X)
    _check(f, W, x)
    _check(jax.grad(f, argnums=(0, 1)), W, x)
    assert any(e.prim == "select_n" for e in pe.trace(f, W, x).eqns)


def test_switch_with_three_branches():
    def f(w, x, k):
        return jax.lax.switch(k, [lambda v: jnp.sum(v), lambda v: jnp.sum(v @ w[0]), lambda v: jnp.max(v)], x)
    for k in (0, 1, 2, 7):      # lax.switch clamps the index
        _check(f, W, X, np.int32(k))


def test_a_run_time_while_is_refused_with_advice():
    def f(x):
        return jax.lax.while_loop(lambda c: jnp.sum(c) < 100.0, lambda c: c * 2.0, x)
    with pytest.raises(UnsupportedPrimitiveError, match="while.*fori_loop"):
        pe.trace(f, np.abs(X) + 1.0)


def test_a_while_with_a_trip_count_known_at_trace_time_is_a_loop():
    """``fori_loop`` with bounds jax keeps as traced values (here jnp scalars) is a ``while``; its
    count is known once traced, so it is a loop of that count (forward only: jax has no reverse-mode
    gradient of a while)."""
    def f(w, x):
        return jnp.sum(jax.lax.fori_loop(jnp.int32(1), jnp.int32(4), lambda i, c: jnp.tanh(c @ w[i]), x))
    _check(f, W, X)
    (loop,) = [e for e in pe.trace(f, W, X).eqns if e.prim == "loop"]
    assert loop.params["length"] == 3


def test_a_while_whose_bounds_are_inputs_is_refused():
    def f(x, n):
        return jax.lax.fori_loop(0, n, lambda i, c: c * 2.0, x)
    with pytest.raises(UnsupportedPrimitiveError, match="while"):
        pe.trace(f, X, np.int32(3))


def test_checkpoint_name_as_maxtext_and_levanter_write_it_traces_and_verifies():
    """``jax.ad_checkpoint.checkpoint_name`` (the identity primitive ``name`` that remat policies read)
    under ``jax.checkpoint`` with a names policy, in a scanned layer stack: traced as the identity it is,
    partitioned, equal to ``jax.jit`` forward and gradient, and verified by ``pe.jit(...).verify``."""
    from jax.ad_checkpoint import checkpoint_name

    policy = jax.checkpoint_policies.save_only_these_names("mlp_out")

    def loss(w, x):
        @functools.partial(jax.checkpoint, policy=policy)
        def layer(c, wl):
            h = checkpoint_name(jnp.tanh(c @ wl), "mlp_out")
            return c + h, None
        c, _ = jax.lax.scan(layer, x, w)
        return jnp.sum(c * c)

    step = jax.value_and_grad(loss)
    _check(step, W, X)
    verdict = pe.jit(step, mesh=MESH, schedule=SCHEDULE).verify(W, X)
    assert verdict.verified, verdict.summary()

"""Correct runs in other summation orders (partir_emu.runtime.rounding): what they perturb and by how much."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from partir_emu.api import trace
from partir_emu.runtime.interpreter import eval_program
from partir_emu.runtime.rounding import ALPHA, other_orders, sum_rounding


def _mlp(w1, w2, x):
    return jnp.sum(jnp.tanh(x @ w1) @ w2, axis=0)


def _args(rng, dtype=np.float32):
    return [rng.standard_normal(s).astype(dtype) for s in ((16, 32), (32, 8), (64, 16))]


def test_without_injected_error_the_runs_are_the_interpreter():
    args = _args(np.random.default_rng(0))
    prog = trace(_mlp, *args)
    plain = eval_program(prog, args)
    for run in other_orders(prog, args, runs=2, alpha=0.0):
        assert all(a.tobytes() == b.tobytes() for a, b in zip(run, plain))


def test_pairs_are_antithetic_and_runs_differ():
    with jax.enable_x64(True):       # float64: the interpreter's own rounding is far below the injected error
        args = _args(np.random.default_rng(1), np.float64)
        prog = trace(_mlp, *args)
    plain = eval_program(prog, args)[0]
    r0, r1, r2, _ = (run[0] for run in other_orders(prog, args, runs=4))
    d0, d1, d2 = r0 - plain, r1 - plain, r2 - plain
    assert np.all(np.abs(d0) > 0)
    np.testing.assert_allclose(d0, -d1, atol=0.1 * np.abs(d0).max())   # first order: opposite errors
    assert np.abs(d2 - d0).max() > 0.1 * np.abs(d0).max()                          # another pair, another draw


def test_the_error_is_relative_to_the_terms_not_the_result():
    """A sum that cancels (1e4 − 1e4 + 1e-3) has a rounding error of the size of its terms' rounding:
    relative to the result it is large, as it really can be."""
    x = np.array([1e4, -1e4, 1e-3], np.float32)
    prog = trace(lambda v: jnp.sum(v), x)
    eqn = next(e for e in prog.eqns if e.prim == "reduce_sum")
    size = float(sum_rounding(eqn, [x]))
    assert size == np.float64(2.0 ** -24) * np.sqrt(3 * (2e8 + 1e-6))
    runs = [float(r[0]) for r in other_orders(prog, [x], runs=4)]
    assert max(abs(r - 1e-3) for r in runs) > 1e-3            # far beyond 1e-3's own rounding
    assert max(abs(r - 1e-3) for r in runs) < 10 * ALPHA * size


def test_counts_follow_the_terms_of_each_element():
    """A scatter-add sums a different number of updates into each row; a padded conv fewer window
    elements at its edges: the count is the implementation's own, run on ones."""
    rows = np.array([0, 0, 0, 2], np.int32)
    upd = np.ones((4, 3), np.float32)
    prog = trace(lambda u: jnp.zeros((3, 3), jnp.float32).at[rows].add(u), upd)
    eqn = next(e for e in prog.eqns if e.prim == "scatter-add")
    ops = [np.zeros((3, 3), np.float32), rows.reshape(4, 1), upd]
    size = sum_rounding(eqn, ops) / 2.0 ** -24
    # row 0: 3 updates and the operand (4 terms, 3 of them 1); row 1: the operand alone (0); row 2: 2 terms
    np.testing.assert_allclose(size[:, 0], [np.sqrt(4 * 3), 0.0, np.sqrt(2 * 1)])


def test_loop_bodies_are_perturbed_every_iteration():
    w = np.random.default_rng(2).standard_normal((8, 8)).astype(np.float32)

    def body(c, _):
        return jnp.tanh(c @ w), jnp.sum(c)

    x = np.ones(8, np.float32)
    prog = trace(lambda c: jax.lax.scan(body, c, None, length=5), x)
    plain = eval_program(prog, [x])
    run = other_orders(prog, [x], runs=1)[0]
    assert not np.array_equal(run[1], plain[1])
    assert np.all(run[1] != plain[1])          # every iteration's sum moved

"""Rotations along a tiled dim (issue 24, the mechanism of pipeline and context parallelism):
``jnp.roll`` (and the concatenation of two slices MaxText's pipeline writes by hand) traces to one
``rotate`` equation, forward and transposed (``compiler/tracing/idioms.py``), and a rotated dim
tiled over mesh axes lowers to ``collective_permute``s of whole blocks, never a gather
(``compiler/lowering/rotate.py``, whose docstring gives the counts checked here).
"""
from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partir_emu
from partir_emu import ManualPartition, Mesh
from partir_emu.compiler.tracing.trace import trace
from partir_emu.core.loops import walk

RNG = np.random.default_rng(24)
X = RNG.standard_normal((8, 5)).astype(np.float32)
W = RNG.standard_normal((8, 5)).astype(np.float32)


def _prims(program) -> Counter:
    return Counter(e.prim for e, _ in walk(program))


def _value_and_grads(shift: int, axis: int = 0):
    def loss(x, w):
        return jnp.sum(jnp.sin(jnp.roll(x * w, shift, axis=axis)) * w)

    return lambda x, w: (jnp.roll(x * w, shift, axis=axis), jax.grad(loss, argnums=(0, 1))(x, w))


def _maxtext_rotate_right(x):
    """MaxText's pipeline rotation, written by hand: the last stage's slice in front of the others."""
    return jnp.concatenate([jax.lax.slice_in_dim(x, x.shape[0] - 1, x.shape[0], axis=0),
                            jax.lax.slice_in_dim(x, 0, x.shape[0] - 1, axis=0)], axis=0)


# -- the tracer finds them -------------------------------------------------------------------------
@pytest.mark.parametrize("shift", [1, 3, -1])
def test_roll_and_its_gradient_trace_to_rotates(shift):
    prog = trace(_value_and_grads(shift), X, W)
    rots = [e for e in prog.eqns if e.prim == "rotate"]
    # the forward roll (twice: the value, and the primal under grad) and its transpose, by -shift
    assert sorted(e.params["shift"] for e in rots) == sorted([shift % 8] * 2 + [-shift % 8])
    assert not {"slice", "split", "pad", "concatenate"} & set(_prims(prog))


def test_a_hand_written_rotation_and_one_inside_a_loop_are_found():
    def step(x):
        y, _ = jax.lax.scan(lambda c, _: (_maxtext_rotate_right(c) * 2.0, None), x, None, length=3)
        return jnp.sum(y * y)

    prog = trace(jax.value_and_grad(step), X)
    loops = [e for e in prog.eqns if e.prim == "loop"]
    assert len(loops) == 2
    body_rots = [[e.params["shift"] for e in lp.params["body"].eqns if e.prim == "rotate"] for lp in loops]
    assert sorted(map(tuple, body_rots)) == [(1,), (7,)]
    assert _prims(prog)["concatenate"] == 0


@pytest.mark.parametrize("fn", [
    lambda x: jnp.concatenate([x[2:], x[:4]], axis=0),            # pieces overlap: not a rotation
    lambda x: jnp.concatenate([x[4:], x[:4] * 2.0], axis=0),      # one piece is not a slice of x
    lambda x: jnp.concatenate([x[1:, 3:], x[:-1, :3]], axis=1),  # pieces cut in two dims
    lambda x: jnp.concatenate([x[::2], x[1::2]], axis=0),         # strided pieces: a shuffle
], ids=["overlap", "scaled", "two-dims", "strided"])
def test_what_is_not_a_rotation_is_left_as_written(fn):
    prog = trace(fn, X)
    assert "rotate" not in _prims(prog)
    np.testing.assert_array_equal(partir_emu.jit(fn, mesh=Mesh(s=1))(X), jax.jit(fn)(X))


# -- the lowering: whole blocks over the axis, never a gather ------------------------------------------
# (shift, devices) -> permutes of one roll: a whole number of blocks is one permute of the whole
# block; otherwise the tail rows come from one member and the head rows from another (local when
# it is this member: q = 0)
@pytest.mark.parametrize("shift,b,per_roll", [(1, 8, 1), (2, 4, 1), (4, 2, 1), (-2, 4, 1), (1, 2, 1), (1, 4, 1),
                                              (3, 4, 2), (5, 4, 2), (-3, 2, 1)])
def test_a_roll_along_a_tiled_dim_is_collective_permutes(shift, b, per_roll):
    fn = _value_and_grads(shift)
    pjit = partir_emu.jit(fn, mesh=Mesh(s=b), schedule=[ManualPartition({"x": 0, "w": 0}, axis="s")])
    got, want = pjit(X, W), jax.jit(fn)(X, W)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    # the rolled value itself is moved, not computed: bit for bit
    np.testing.assert_array_equal(got[0], want[0])
    spmd = pjit.lower(X, W).spmd
    counts = _prims(spmd.program)
    assert counts["collective_permute"] == 3 * per_roll and counts["rotate"] == 0, counts
    assert not counts["all_gather"] and not counts["all_to_all"], counts
    # each roll by s (the value, the primal under grad: shift; the transpose: -shift) moves, with
    # s mod 8 = q blocks + r rows: the whole block q members on (r = 0), else its last r rows q + 1
    # members on and its first rows q members on (no permute for q = 0, a whole turn)
    blk = 8 // b
    want: Counter = Counter()
    for s in (shift, shift, -shift):
        q, r = divmod(s % 8, blk)
        moves = [(blk, q)] if r == 0 else [(r, (q + 1) % b), (blk - r, q % b)]
        want.update(m for m in moves if m[1])
    got = Counter((e.inputs[0].shape[0], e.params["shift"]) for e in spmd.program.eqns if e.prim == "collective_permute")
    assert got == want
    assert all(e.params["axes"] == ("s",) and e.params["wrap"] is True
               for e in spmd.program.eqns if e.prim == "collective_permute")


def test_a_rotation_over_two_axes_moves_along_the_flattened_group():
    fn = _value_and_grads(2)
    pjit = partir_emu.jit(fn, mesh=Mesh(a=2, b=2), schedule=[ManualPartition({"x": 0, "w": 0}, axis="a"),
                                                             ManualPartition({"x": 0, "w": 0}, axis="b")])
    for g, w in zip(jax.tree.leaves(pjit(X, W)), jax.tree.leaves(jax.jit(fn)(X, W))):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    perms = [e for e in pjit.lower(X, W).spmd.program.eqns if e.prim == "collective_permute"]
    assert len(perms) == 3 and {e.params["axes"] for e in perms} == {("a", "b")}


def test_a_rotation_of_an_untiled_dim_stays_local():
    fn = _value_and_grads(2, axis=0)
    pjit = partir_emu.jit(fn, mesh=Mesh(s=5), schedule=[ManualPartition({"x": 1, "w": 1}, axis="s")])
    for g, w in zip(jax.tree.leaves(pjit(X, W)), jax.tree.leaves(jax.jit(fn)(X, W))):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    counts = _prims(pjit.lower(X, W).spmd.program)
    assert counts["rotate"] == 3 and not counts["collective_permute"] and not counts["all_gather"]


def test_a_bfloat16_roll_in_a_loop_and_its_gradient_are_permutes():
    """jax writes a bfloat16 zero as a constant, which a loop body receives as an input: the
    transposed roll's zero pads are still recognised there (as MaxText's bf16 pipeline needs)."""
    def step(x):
        h = x.astype(jnp.bfloat16)
        h, _ = jax.lax.scan(lambda c, _: (jnp.roll(jnp.sin(c), 1, axis=0), None), h, None, length=3)
        return jnp.sum(h.astype(jnp.float32) ** 2)

    fn = jax.value_and_grad(step)
    pjit = partir_emu.jit(fn, mesh=Mesh(s=4), schedule=[ManualPartition({"x": 0}, axis="s")])
    got, want = pjit(X), jax.jit(fn)(X)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-2)
    np.testing.assert_allclose(got[1], want[1], rtol=2e-2, atol=2e-2)
    counts = _prims(pjit.lower(X).spmd.program)
    assert counts["collective_permute"] == 2 and not counts["all_gather"], counts     # one in each loop body

"""``partir_emu.tag(x, name)``: the identity under jax (its gradient tags the cotangent), traced as the
``tag`` primitive, a place a tactic may stop (``ManualPartition(stop_at=...)``) and where the lowering
reshards: two sides tiled differently by one axis meet there in one all_to_all."""
from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partir_emu
from partir_emu import ManualPartition, Mesh
from partir_emu.compiler.tracing.trace import trace
from partir_emu.errors import ArgumentError, TacticError

RNG = np.random.default_rng(3)
X = RNG.standard_normal((4, 4, 3)).astype(np.float32)      # [G, E, D]: tiled on G by the data tactic
W = RNG.standard_normal((4, 3)).astype(np.float32)         # [E, D]: tiled on E by the "expert" tactic


def _model(x, w):
    """An expert-like block: tokens [G, E, D] turned into [E, G, D], scaled per E by w, turned back."""
    t = partir_emu.tag(jnp.swapaxes(x, 0, 1) * 2.0, "swap/in")
    y = partir_emu.tag(jnp.tanh(t * w[:, None, :]), "swap/out")
    return jnp.sum((jnp.swapaxes(y, 0, 1) + x) ** 2)


def _step(x, w):
    return jax.value_and_grad(_model, argnums=(0, 1))(x, w)


def _collectives(spmd) -> Counter:
    return Counter((e.prim, tuple(e.params["axes"])) for e in spmd.collectives())


def test_tag_is_the_identity_and_tags_its_cotangent():
    untagged = lambda x, w: jnp.sum((jnp.swapaxes(jnp.tanh(jnp.swapaxes(x, 0, 1) * 2.0 * w[:, None, :]), 0, 1) + x) ** 2)
    for got, want in zip(jax.tree.leaves(jax.jit(_step)(X, W)),
                         jax.tree.leaves(jax.jit(jax.value_and_grad(untagged, argnums=(0, 1)))(X, W))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    prog = trace(_step, X, W)
    names = Counter(e.params["name"] for e in prog.eqns if e.prim == "tag")
    assert names == {"swap/in": 2, "swap/out": 2}        # forward and backward
    assert jax.jit(jax.vmap(lambda x: partir_emu.tag(x, "v")))(X).shape == X.shape


def test_stopping_at_the_tags_meets_in_all_to_alls():
    ep = ManualPartition({"a1": 0}, axis="a", name="ep", stop_at=("swap/*",))
    bp = ManualPartition({"a0": 0}, axis="a", name="bp")
    f = partir_emu.jit(lambda a0, a1: _step(a0, a1), mesh=Mesh(a=2), schedule=[ep, bp])
    spmd = f.lower(X, W).spmd
    # forward: in and out; backward: the cotangents of out and in, each G <-> E on axis a
    assert _collectives(spmd)[("all_to_all", ("a",))] == 4
    assert not any(e.prim == "all_gather" for e in spmd.collectives())
    assert not any(e.prim == "tag" for e in spmd.program.eqns)
    assert f.verify(X, W).verified


def test_without_stop_the_expert_tiling_reaches_the_tokens():
    def tiled_dims(schedule):
        spmd = partir_emu.jit(lambda a0, a1: _step(a0, a1), mesh=Mesh(a=2), schedule=schedule).lower(X, W).spmd
        return spmd.in_shardings[0].dims
    # through the tags to x's E dim, where the data tactic then cannot put the axis
    assert tiled_dims([ManualPartition({"a1": 0}, axis="a")]) == ((), ("a",), ())
    assert tiled_dims([ManualPartition({"a1": 0}, axis="a", stop_at=("swap/*",))]) == ((), (), ())


def test_tags_are_transparent_to_a_tactic_that_does_not_stop():
    bp = ManualPartition({"a0": 0}, axis="a", name="bp")
    spmd = partir_emu.jit(lambda a0, a1: _step(a0, a1), mesh=Mesh(a=2), schedule=[bp]).lower(X, W).spmd
    assert set(_collectives(spmd)) == {("all_reduce", ("a",))}


def test_bad_stop_at_and_tag_names_are_named():
    with pytest.raises(TacticError, match=r"stop_at pattern 'moe/\*' matches no tag.*'swap/in', 'swap/out'"):
        partir_emu.jit(lambda a0, a1: _step(a0, a1), mesh=Mesh(a=2),
                       schedule=[ManualPartition({"a1": 0}, axis="a", stop_at=("moe/*",))]).lower(X, W)
    with pytest.raises(TacticError, match="tuple of tag-name globs"):
        ManualPartition({"w": 0}, axis="a", stop_at="swap/*")
    with pytest.raises(ArgumentError, match="non-empty string"):
        partir_emu.tag(X, "")

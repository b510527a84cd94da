"""Context parallelism with ring attention (issue 24 item 3; ``scenarios/transformer/ring_attention.py``):

- the ring is causal attention: values and gradients equal the naive core's under plain jax, for
  4 and 8 blocks and grouped-query heads;
- the step with ``attention=ring`` partitions under ``cp`` (and bp+mp+cp, and pp+cp) and verifies
  against ``jax.jit``;
- structure: per layer ``C - 1`` key/value blocks forward and ``C - 1`` key/value plus ``C`` gradient
  blocks backward, each one ``collective_permute`` of one block over ``context``, no all_gather;
  another attention core under cp gathers the keys and values instead (all-gather context parallelism);
- priced: the analytical model and the DES agree on the ring;
- bad configurations are clear errors.
"""
from __future__ import annotations

import functools
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from partir_emu.app.experiment import Experiment
from partir_emu.core.mesh import Mesh
from partir_emu.hwmodels.analytical import Analyzer
from partir_emu.hwmodels.des import simulate_des
from scenarios.transformer.attention import naive_attention
from scenarios.transformer.ring_attention import ring_attention
from tests.conftest import assert_schedule_refused, verified_on_local_mesh

RNG = np.random.default_rng(3)
RING = "batch=4,layers=2,attention=ring"


@pytest.mark.parametrize("blocks, heads, kv_heads", [(4, 4, 2), (8, 2, 1)])
def test_the_ring_is_causal_attention(blocks, heads, kv_heads):
    q = RNG.standard_normal((2, 16, heads, 8)).astype(np.float32)
    k, v = (RNG.standard_normal((2, 16, kv_heads, 8)).astype(np.float32) for _ in range(2))
    w = RNG.standard_normal(q.shape).astype(np.float32)

    def loss(core, q, k, v):
        return jnp.sum(core(q, k, v) * w)

    ring = functools.partial(ring_attention, blocks=blocks)
    np.testing.assert_allclose(jax.jit(ring)(q, k, v), naive_attention(q, k, v), atol=2e-6)
    got = jax.grad(functools.partial(loss, ring), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(functools.partial(loss, naive_attention), argnums=(0, 1, 2))(q, k, v)
    for g, x in zip(got, want):
        np.testing.assert_allclose(g, x, atol=4e-6)


@functools.cache
def _base(overrides: str) -> Experiment:
    return Experiment("transformer", "bp", Mesh(batch=1), "tiny", overrides, strict=True)


@pytest.mark.parametrize("overrides, strategy, mesh", [
    (f"{RING},ring_blocks=4", "cp", "context=4"),
    (f"{RING},ring_blocks=2", "bp+mp+cp", "batch=2,model=2,context=2"),
    ("batch=8,layers=2,attention=ring,ring_blocks=2,pipeline=2,microbatches=2", "pp+cp", "stage=2,context=2"),
], ids=["cp", "bp+mp+cp", "pp+cp"])
def test_ring_attention_verifies_under_cp(overrides, strategy, mesh):
    exp = _base(overrides).with_strategy(strategy, Mesh.parse(mesh))
    spmd, ver = verified_on_local_mesh(exp)
    assert ver.verified, ver.to_json()["worst"]
    assert spmd.in_shardings[spmd.input_names.index("batch/tokens")].dims[1][-1] == "context"


def test_each_layer_passes_key_value_blocks_round_the_ring():
    """C = 4 blocks on a context axis of 4, 2 layers: per layer 3 key/value blocks forward, 3 again
    and 4 gradient blocks (float32) backward; each a [b, 1, s/C, 2, kv, dh] block moved one device on."""
    spmd = _base(f"{RING},ring_blocks=4").with_strategy("cp", Mesh(context=4)).lower().spmd
    on_context = Counter(e.prim for e in spmd.collectives() if "context" in e.params["axes"])
    assert on_context["collective_permute"] == 2 * (3 + 3 + 4) and not on_context["all_gather"], on_context
    perms = Counter((e.inputs[0].shape, e.inputs[0].dtype, e.params["shift"])
                    for e in spmd.collectives() if e.prim == "collective_permute")
    assert perms == {((4, 1, 2, 2, 4, 4), "float32", 1): 2 * 10}
    # the rest of the layer is per position: what crosses context besides the ring is the weight
    # gradients' and the loss's sums over the sequence
    assert set(on_context) == {"collective_permute", "all_reduce"}


def test_another_core_under_cp_gathers_keys_and_values():
    """Without the ring the sequence tilings meet at the scores: keys and values are all-gathered over
    context (Llama 3's all-gather context parallelism), their gradients reduce-scattered."""
    spmd = _base("batch=4,layers=2").with_strategy("cp", Mesh(context=2)).lower().spmd
    on_context = Counter(e.prim for e in spmd.collectives() if "context" in e.params["axes"])
    assert on_context["all_gather"] >= 4 and not on_context["collective_permute"], on_context


def test_the_des_replays_the_ring_as_priced():
    cfg = "batch=8,seq=4096,d_model=1024,heads=8,d_ff=4096,layers=2,vocab=1024,attention=ring,ring_blocks=4"
    spmd = Experiment("transformer", "cp", Mesh(context=4), "t32", cfg).lower().spmd
    an = Analyzer().simulate(spmd, "tpu-v4")
    des = simulate_des(spmd, "tpu-v4")
    assert des.step_s == pytest.approx(an.step_s, rel=1e-6)
    assert an.by_collective["collective_permute"]["count"] > 0


@pytest.mark.parametrize("overrides, strategy, mesh, needle", [
    ("batch=4,ring_blocks=2", "bp", "batch=1", r"ring_blocks=2 without attention=ring"),
    ("batch=4,attention=ring,ring_blocks=3", "bp", "batch=1", r"seq=8 is not divisible by ring_blocks=3"),
    ("batch=4,attention=ring,ring_blocks=2", "cp", "context=4", r"ring_blocks=2 blocks cannot be split over axis 'context' of size 4; set --set ring_blocks=4"),
    ("batch=4,attention=ring,ring_blocks=2", "cp", "batch=2", r"cp needs mesh axis 'context'"),
])
def test_bad_rings_are_clear_errors(overrides, strategy, mesh, needle):
    assert_schedule_refused(overrides, strategy, mesh, needle)
